"""One rank of the watchdog test: a DCP save whose coordinator is held in create_global_plan.

    python watchdog_job.py OUT_DIR

The hold is the test's stand-in for a long planning phase (the watchdog is under test, not
the planner). The watchdog fires at 1/4 of an 8 s deadline; the hold lasts until every rank's
stack file is written and rank 0 logged its summary (120 s at most), not a fixed time that a
loaded machine could outlast.
"""

import datetime
import logging
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner

from ckptdoctor.fix.watchdog import SaveWatchdog


class Summarised(logging.Handler):
    """Notes that rank 0's watchdog logged its one summary line."""

    def __init__(self):
        super().__init__()
        self.seen = threading.Event()

    def emit(self, record):
        if "stacks in" not in record.getMessage():
            self.seen.set()


SUMMARY = Summarised()


class SlowCoordinator(DefaultSavePlanner):
    def __init__(self, out: Path, world: int):
        super().__init__()
        self.files = [out / "watchdog" / f"rank{r}.txt" for r in range(world)]

    def create_global_plan(self, all_plans):
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not (SUMMARY.seen.is_set() and all(f.exists() for f in self.files)):
            time.sleep(0.05)
        return super().create_global_plan(all_plans)


def main() -> int:
    out = Path(sys.argv[1])
    logging.basicConfig(level=logging.WARNING, format="%(message)s", stream=sys.stdout)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    logging.getLogger("ckptdoctor.fix.watchdog").addHandler(SUMMARY)
    state = {"w": torch.full((4,), float(dist.get_rank()))}
    with SaveWatchdog(deadline_s=8.0, fraction=0.25, out_dir=out / "watchdog", interval_s=0.2, summary_delay_s=1.0):
        dcp.save(state, checkpoint_id=out / "ckpt", planner=SlowCoordinator(out, dist.get_world_size()))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

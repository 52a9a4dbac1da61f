"""A live watchdog for saves: evidence before the deadline kills it.

    with SaveWatchdog(deadline_s=1800, fraction=0.5, out_dir="watchdog"):
        accelerator.save_state(step_dir)

Each rank follows the save's phases from torch's own DCP logger events (the same events
timeline.py reads). A daemon thread checks once per `interval_s`: when one phase has run
longer than `fraction * deadline_s`, the rank writes its Python stack (faulthandler, all
threads) and its phase to `out_dir/rank<N>.txt` and logs one line. It posts its phase to the
job's TCP store (a key write, not a collective: the hung group is never touched), and rank
0's thread, a few seconds later, logs one summary line over all ranks:
"rank 0: global plan (create_global_plan) for 412 s; ranks 1-1143: waiting for the plan (gather + scatter) for 415 s".
"""

from __future__ import annotations

import faulthandler
import logging
import threading
import time
from pathlib import Path

from ..ranks import format_ranks

log = logging.getLogger(__name__)
STORE_PREFIX = "ckptdoctor/watchdog/"

# (DCP step, event) -> the phase this rank is in from then on
PHASE_AFTER = {
    ("local_step", "START"): "local plan",
    ("local_step", "END"): "waiting for the plan (gather + scatter)",
    ("global_step", "START"): "global plan (create_global_plan)",
    ("global_step", "END"): "scatter of the plans",
    ("write_data", "START"): "write",
    ("write_data", "END"): "finish (gather of write results)",
    ("finish_checkpoint", "START"): "finish (metadata)",
    ("finish_checkpoint", "END"): "finish (result broadcast)",
    ("save", "END"): "idle",
}


class SaveWatchdog(logging.Handler):
    def __init__(self, deadline_s: float, fraction: float = 0.5, out_dir: str | Path = "watchdog",
                 interval_s: float = 1.0, store=None, rank: int | None = None, world_size: int | None = None,
                 summary_delay_s: float | None = None):
        super().__init__(level=logging.DEBUG)
        import torch.distributed as dist

        self.threshold_s = deadline_s * fraction
        self.out_dir = Path(out_dir)
        self.interval_s = interval_s
        self.rank = dist.get_rank() if rank is None else rank
        self.world_size = dist.get_world_size() if world_size is None else world_size
        self.store = store if store is not None else _default_store()
        self.summary_delay_s = 3 * interval_s if summary_delay_s is None else summary_delay_s
        self.phase, self.since = "idle", time.monotonic()
        self.fired: list[str] = []  # phases this rank reported
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="ckptdoctor-save-watchdog", daemon=True)

    # -- phase tracking (called by torch's DCP logger, on the saving thread) ------------------
    def emit(self, record: logging.LogRecord) -> None:
        msg = record.msg
        if isinstance(msg, dict):
            phase = PHASE_AFTER.get((msg.get("func_name"), str(msg.get("event", "")).upper()))
            if phase is not None and phase != self.phase:
                self.phase, self.since = phase, time.monotonic()

    def __enter__(self) -> "SaveWatchdog":
        self.out_dir.mkdir(parents=True, exist_ok=True)
        dcp_logger().addHandler(self)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        dcp_logger().removeHandler(self)

    # -- the watching thread: files, one log line, a store key; never a collective ----------
    def _watch(self) -> None:
        summary_at = None
        while not self._stop.wait(self.interval_s):
            phase, elapsed = self.phase, time.monotonic() - self.since
            if phase != "idle" and elapsed >= self.threshold_s and phase not in self.fired:
                self.fired.append(phase)
                self._report(phase, elapsed)
                if self.rank == 0 and self.store is not None and summary_at is None:
                    summary_at = time.monotonic() + self.summary_delay_s
            if summary_at is not None and time.monotonic() >= summary_at:
                summary_at = None
                log.warning("ckptdoctor watchdog: %s", self.summary())

    def _report(self, phase: str, elapsed: float) -> None:
        path = self.out_dir / f"rank{self.rank}.txt"
        with open(path, "a") as f:
            f.write(f"rank {self.rank}: {phase} for {elapsed:.0f} s (threshold {self.threshold_s:.0f} s)\n")
            f.flush()
            faulthandler.dump_traceback(file=f, all_threads=True)
            f.write("\n")
        log.warning("ckptdoctor watchdog: rank %d: %s for %.0f s; stacks in %s", self.rank, phase, elapsed, path)
        if self.store is not None:
            self.store.set(f"{STORE_PREFIX}{self.rank}", f"{phase}|{elapsed:.0f}")

    def summary(self) -> str:
        """One line over all ranks that reported, grouped by phase (rank 0 calls it)."""
        groups: dict[str, list[tuple[int, float]]] = {}
        silent = []
        for rank in range(self.world_size):
            key = f"{STORE_PREFIX}{rank}"
            if not self.store.check([key]):
                silent.append(rank)
                continue
            phase, seconds = self.store.get(key).decode().rsplit("|", 1)
            groups.setdefault(phase, []).append((rank, float(seconds)))
        parts = []
        for phase, members in sorted(groups.items(), key=lambda kv: kv[1][0][0]):
            ranks = [r for r, _ in members]
            label = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {format_ranks(ranks)}"
            parts.append(f"{label}: {phase} for {max(s for _, s in members):.0f} s")
        if silent:
            parts.append(f"ranks {format_ranks(silent)}: nothing reported (below the threshold, or gone)")
        return "; ".join(parts)


def dcp_logger() -> logging.Logger:
    """The logger torch's `_dcp_method_logger` writes each DCP step's start/end events to
    ("c10d-NullHandler-dcp_logger" in torch 2.8 and 2.14: DEBUG level, not propagating)."""
    from torch.distributed.checkpoint import logger as dcp_logging

    return dcp_logging._dcp_logger


def _default_store():
    """The job's TCP store, or None (then no cross-rank summary; each rank still reports itself)."""
    from .heartbeat import job_store

    try:
        return job_store()
    except Exception:  # noqa: BLE001
        return None

"""One rank of the kill test (started by tests/test_checkpointing.py through the launcher).

    python kill_job.py train SPEC.json VICTIM   train 2 steps, save after each with the fix;
                                                rank VICTIM dies inside step 2's model save
    python kill_job.py resume SPEC.json         load the latest complete checkpoint, report it

The kill is `os._exit` inside the planner's local step on one rank: the fault under test.
"""

import json
import os
import sys
from pathlib import Path

from ckptdoctor.fix import planner
from ckptdoctor.repro import worker
from ckptdoctor.fix.checkpointing import ScalableCheckpointing


def arm(victim: int, results_dir: str) -> None:
    original = planner.ScalableSavePlanner.create_local_plan
    calls = {"n": 0}

    def create_local_plan(self):
        calls["n"] += 1
        if calls["n"] == 3 and int(os.environ["RANK"]) == victim:  # step 1: model, optimizer; step 2: model
            Path(results_dir, "killed_at").write_text(repr(__import__("time").time()))
            os._exit(9)
        return original(self)

    planner.ScalableSavePlanner.create_local_plan = create_local_plan


def resume(spec_path: str) -> int:
    import datetime

    import torch.distributed as dist

    from ckptdoctor.repro.trainer import AccelerateTrainer

    spec = worker.WorkerSpec.from_json(Path(spec_path).read_text())
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=120))
    trainer = AccelerateTrainer(spec.config, spec.shape, spec.output_dir, group)
    ckpt = ScalableCheckpointing(trainer.accelerator, timeout_s=120)
    latest = ckpt.latest(spec.output_dir, "accelerator")
    ckpt.load_state(latest)
    Path(spec.results_dir, f"resume{dist.get_rank()}.json").write_text(json.dumps({"loaded": str(latest)}))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    if sys.argv[1] == "train":
        arm(int(sys.argv[3]), json.loads(Path(sys.argv[2]).read_text())["results_dir"])
        sys.exit(worker.main([sys.argv[2]]))
    sys.exit(resume(sys.argv[2]))

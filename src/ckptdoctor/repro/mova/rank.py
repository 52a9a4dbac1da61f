"""One rank of MOVA's own trainer on CPU, under `accelerate launch`:

    accelerate launch --config_file <extract>/configs/training/accelerate/fsdp_8.yaml \\
        -m ckptdoctor.repro.mova.rank SPEC.json

Before MOVA's `scripts/training_scripts/accelerate_train.py` runs as `__main__` (with the run's
config file as its argument), this rank:

* puts the stand-ins (`standins/`: torch_npu, torchair, audiotools; torchcodec's decoders for one
  import, `torchcodec_standin.py`) and the scratch
  copy of the MOVA extract first on `sys.path`, and registers the tiny pipeline and dataset
  (`pipeline.py`) in MOVA's registries;
* scales the deadline, not the mechanism: MOVA's `init_process_group` passes no timeout, so the
  default group gets torch's default (30 min for gloo); here that default is the scaled deadline
  while MOVA creates its group, and the training timeout for every group created after it
  (Accelerate's device mesh, which carries FSDP's collectives: HCCL's job on NPU);
* makes the CPU adjustments of `repro/accelerate_cpu.py` right after MOVA's own
  `init_distributed_adapter` returns: Accelerate's FSDP2 path on CPU, unpinned CPU offload;
* freezes the objects of MOVA's setup for the garbage collector as its `train()` starts
  (`worker.freeze_setup_objects`, which says why), and lets the ranks meet on a long-timeout group
  before each `_save_checkpoint` (`align_ranks_before_movas_saves` says why);
* installs the pass-through probes (DCP events; timed collectives when calibrating) and, if the
  spec says so, one fault (a rank that exits or freezes in a given save's local plan).

It writes `results/rank<N>.json` (outcome, frames, losses, DCP events), even when torn down, and
lets any exception escape, so that the traceback and torchrun's teardown are MOVA's own.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import runpy
import signal
import sys
import time
import traceback
from pathlib import Path

STANDINS = Path(__file__).resolve().parent / "standins"
TRAIN_SCRIPT = Path("scripts") / "training_scripts" / "accelerate_train.py"


@dataclasses.dataclass
class MovaRankSpec:
    extract: str                  # the scratch copy of the MOVA extract (patched or not)
    config: str                   # the mmengine config file MOVA's script is given
    results_dir: str
    deadline_s: float             # the default group's gloo timeout (the reporter's 1800 s, scaled)
    training_timeout_s: float = 1800.0
    time_collectives: bool = False
    fault: dict | None = None     # {"kind": "exit"|"sigstop", "rank": R, "save": "optimizer_0", "call": K}

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> "MovaRankSpec":
        return cls(**json.loads(text))


def import_movas_dataset_module() -> None:
    """Import mova.datasets.video_audio_dataset with torchcodec's two decoder names lent for
    that import only (torchcodec_standin.py says why)."""
    import types

    from . import torchcodec_standin

    package, decoders = types.ModuleType("torchcodec"), types.ModuleType("torchcodec.decoders")
    decoders.AudioDecoder, decoders.VideoDecoder = torchcodec_standin.AudioDecoder, torchcodec_standin.VideoDecoder
    package.decoders = decoders
    sys.modules.update({"torchcodec": package, "torchcodec.decoders": decoders})
    try:
        import mova.datasets.video_audio_dataset  # noqa: F401
    finally:
        del sys.modules["torchcodec"], sys.modules["torchcodec.decoders"]


def scaled_default_timeout(deadline_s: float, training_timeout_s: float) -> None:
    """The default group (MOVA's, created without a timeout) gets `deadline_s`; groups made
    after it get `training_timeout_s` (torch reads this default at each group's creation)."""
    import torch.distributed.distributed_c10d as c10d

    c10d.default_pg_timeout = datetime.timedelta(seconds=deadline_s)
    original = c10d.init_process_group

    def init_process_group(*args, **kwargs):
        try:
            return original(*args, **kwargs)
        finally:
            c10d.default_pg_timeout = datetime.timedelta(seconds=training_timeout_s)
    c10d.init_process_group = init_process_group


def adjust_for_cpu_after_movas_init() -> None:
    """Run repro/accelerate_cpu.py's adjustments right after MOVA's own init_distributed_adapter."""
    import mova.utils.adapter as adapter

    from ..accelerate_cpu import enable_fsdp_on_cpu, unpinned_cpu_offload

    original = adapter.init_distributed_adapter

    def init_distributed_adapter():
        original()
        enable_fsdp_on_cpu()
        unpinned_cpu_offload()
    adapter.init_distributed_adapter = init_distributed_adapter


def align_ranks_before_movas_saves(training_timeout_s: float) -> None:
    """Before each of MOVA's `_save_checkpoint` calls, every rank meets on a group with the training
    timeout (a pass-through wrapper; MOVA's method then runs unchanged, its own wait_for_everyone
    included). Why: eight ranks finish their optimizer step on two shared cores up to 2.7 s apart
    (newest stack); that is training, which the scaled deadline must not govern, but MOVA's first
    barrier in `_save_checkpoint` is on the default group and would charge it to the deadline
    (docs/evidence/repro_separation.txt). The group is made right after MOVA's own
    `init_process_group`, on every rank, before any other."""
    import datetime

    import mova.utils.adapter as adapter
    import torch.distributed as dist
    from mova.engine.trainer.accelerate import accelerate_trainer

    group = {}
    original_init = adapter.init_distributed_adapter

    def init_distributed_adapter():
        original_init()
        group["aligned"] = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=training_timeout_s))
    adapter.init_distributed_adapter = init_distributed_adapter
    original_save = accelerate_trainer.AccelerateTrainer._save_checkpoint

    def _save_checkpoint(self, *args, **kwargs):
        dist.barrier(group=group["aligned"])
        return original_save(self, *args, **kwargs)
    accelerate_trainer.AccelerateTrainer._save_checkpoint = _save_checkpoint


def freeze_setup_objects_before_movas_training() -> None:
    """worker.freeze_setup_objects() as MOVA's `AccelerateTrainer.train` starts (a pass-through)."""
    from mova.engine.trainer.accelerate import accelerate_trainer

    from ..worker import freeze_setup_objects

    original = accelerate_trainer.AccelerateTrainer.train

    def train(self):
        freeze_setup_objects()
        return original(self)
    accelerate_trainer.AccelerateTrainer.train = train


def arm_fault(fault: dict, rank: int, results_dir: str, probe) -> None:
    """The fault under test: rank `fault["rank"]` exits (or freezes, SIGSTOP) in the local plan
    of the `call`-th DCP save whose directory is `save` (from the probe's DCP events).
    Nothing else changes."""
    from torch.distributed.checkpoint import DefaultSavePlanner

    original = DefaultSavePlanner.create_local_plan
    seen = {"n": 0}

    def create_local_plan(planner):
        save = next((e.save for e in reversed(probe.events) if e.step == "local_step"), "")
        if rank == fault["rank"] and save.split("@")[0] == fault["save"]:
            seen["n"] += 1
            if seen["n"] == fault.get("call", 1):
                Path(results_dir, "fault_at").write_text(repr(time.time()))
                if fault["kind"] == "sigstop":
                    os.kill(os.getpid(), signal.SIGSTOP)
                else:
                    os._exit(9)
        return original(planner)

    DefaultSavePlanner.create_local_plan = create_local_plan


def main(argv: list[str] | None = None) -> int:
    spec = MovaRankSpec.from_json(Path((argv or sys.argv[1:])[0]).read_text())
    rank = int(os.environ["RANK"])
    sys.path[:0] = [str(STANDINS), spec.extract]
    import torch

    from ..probes import SaveProbe
    from ..worker import RankReport, frames_of, keep_evidence_on_sigterm

    torch.set_num_threads(1)
    scaled_default_timeout(spec.deadline_s, spec.training_timeout_s)
    import_movas_dataset_module()
    adjust_for_cpu_after_movas_init()
    align_ranks_before_movas_saves(spec.training_timeout_s)
    freeze_setup_objects_before_movas_training()
    from . import pipeline  # noqa: F401 - registers TinyMOVATrain and TinyVideoAudioDataset in MOVA's registries

    probe = SaveProbe(rank).install(time_collectives=spec.time_collectives)
    report = RankReport(spec.results_dir, rank, probe)
    keep_evidence_on_sigterm(report)
    if spec.fault:
        arm_fault(spec.fault, rank, spec.results_dir, probe)
    sys.argv = [str(Path(spec.extract) / TRAIN_SCRIPT), spec.config]
    os.chdir(spec.extract)
    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
    except BaseException as error:
        report.write(status="failed", error_type=type(error).__name__, error=str(error).strip()[-4000:],
                     error_time_s=time.time(), frames=frames_of(error.__traceback__), losses=_losses())
        raise
    report.write(status="ok", losses=_losses(), rng_digests=_rng_digests())
    return 0


def _losses() -> list[float]:
    from .pipeline import TinyMOVATrain

    return list(TinyMOVATrain.last_losses)


def _rng_digests() -> list[int]:
    from .pipeline import TinyMOVATrain

    return list(TinyMOVATrain.rng_digests)


if __name__ == "__main__":
    sys.exit(main())

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
  while MOVA creates its group, and the training timeout for every group created after it; the
  ranks meet just before that group is made (`meet_before_the_default_group` says why);
* puts FSDP's collectives (HCCL's job on NPU) on a group of their own with the training timeout,
  and lets the ranks meet on it as `train()` starts and before each `_save_checkpoint`
  (`training_group_for_fsdp_and_movas_saves` says why);
* makes the CPU adjustments of `selftest/accelerate_cpu.py` right after MOVA's own
  `init_distributed_adapter` returns: Accelerate's FSDP2 path on CPU, unpinned CPU offload;
* freezes the objects of MOVA's setup for the garbage collector as its `train()` starts
  (`worker.freeze_setup_objects`, which says why);
* installs the pass-through probes (DCP events; timed collectives when calibrating) and, if the
  spec says so, one fault (a rank that exits or freezes in a given save's local plan).

It writes `results/rank<N>.json` (outcome, frames, losses, DCP events), even when torn down, and
lets any exception escape, so that the traceback and torchrun's teardown are MOVA's own.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import os
import runpy
import signal
import sys
import threading
import time
from pathlib import Path

STANDINS = Path(__file__).resolve().parent / "standins"
TRAIN_SCRIPT = Path("scripts") / "training_scripts" / "accelerate_train.py"
FROZEN_PID = "frozen_pid"  # in the results directory: the pid of the rank the fault froze


@dataclasses.dataclass
class MovaRankSpec:
    extract: str                  # the scratch copy of the MOVA extract (patched or not)
    config: str                   # the mmengine config file MOVA's script is given
    results_dir: str
    deadline_s: float             # the default group's gloo timeout (the reporter's 1800 s, scaled)
    training_timeout_s: float = 1800.0
    time_collectives: bool = False
    fault: dict | None = None     # {"kind": "exit"|"sigstop", "rank": R, "save": "optimizer_0", "call": K}
    roundtrip: bool = False       # after training, resume from "final" through MOVA's own code and compare

    def __post_init__(self):
        # The rank changes into the extract's copy before MOVA runs: a relative path would then
        # point inside it. Resolved here, against the directory the job was started from.
        for field in ("extract", "config", "results_dir"):
            setattr(self, field, os.path.abspath(getattr(self, field)))

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
        meet_before_the_default_group(training_timeout_s)
        try:
            return original(*args, **kwargs)
        finally:
            c10d.default_pg_timeout = datetime.timedelta(seconds=training_timeout_s)
    c10d.init_process_group = init_process_group


ARRIVED, ALL_ARRIVED = "ckptdoctor/arrived-at-init", "ckptdoctor/all-arrived-at-init"


def meet_before_the_default_group(timeout_s: float) -> None:
    """Every rank waits here (on torchrun's own store, `timeout_s`) until all have arrived.

    Creating the gloo group connects every pair of ranks, and each waits for the others'
    addresses with the group's timeout: the scaled deadline. Eight ranks finish importing MOVA
    on two shared cores seconds apart, so a deadline under a second could time out here, in
    `init_process_group` (a LoRA attempt at 330 ms did: `wait timeout after 330ms, keys:
    /default_pg/0//cpu//0/0`). Startup skew is not what the reporter's 1,800 s measured. Without
    torchrun's agent store (TORCHELASTIC_USE_AGENT_STORE) there is no store before the group's
    own, and nothing is done."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return
    import torch.distributed as dist

    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=datetime.timedelta(seconds=timeout_s))
    if store.add(ARRIVED, 1) == int(os.environ["WORLD_SIZE"]):
        store.set(ALL_ARRIVED, "1")
    store.wait([ALL_ARRIVED])


def adjust_for_cpu_after_movas_init() -> None:
    """Run selftest/accelerate_cpu.py's adjustments right after MOVA's own init_distributed_adapter."""
    import mova.utils.adapter as adapter

    from ...selftest.accelerate_cpu import enable_fsdp_on_cpu, unpinned_cpu_offload

    original = adapter.init_distributed_adapter

    def init_distributed_adapter():
        original()
        enable_fsdp_on_cpu()
        unpinned_cpu_offload()
    adapter.init_distributed_adapter = init_distributed_adapter


def training_group_for_fsdp_and_movas_saves(training_timeout_s: float) -> None:
    """Right after MOVA's own `init_process_group`, every rank makes one more gloo group with the
    training timeout, and it carries what is training, not checkpointing (pass-through wrappers):

    * FSDP's collectives. fsdp_8.yaml's mesh is cp 4 x dp_shard 2, and FSDP shards over its
      flattened "dp_shard_cp" dimension, all 8 ranks: torch's DeviceMesh reuses the default group
      for a dimension over the whole world (with gloo and no CUDA), so the scaled deadline would
      bound every all-gather, reduce-scatter and grad-norm all-reduce (a patched LoRA run timed out
      in `clip_grad_norm_` that way). On the reporter's NPUs those run on HCCL, whose timeout is
      not the one in the report. While Accelerate builds its mesh, DeviceMesh is given this group
      where it would take the default one (`whole_world_meshes_on`); the other dimensions are
      new groups either way.
    * A meeting before each of MOVA's `_save_checkpoint` calls: eight ranks finish their optimizer
      step on two shared cores up to 2.7 s apart (newest stack); MOVA's first barrier in
      `_save_checkpoint` is on the default group and would charge that to the deadline
      (docs/evidence/repro_separation.txt). MOVA's method then runs unchanged.
    * A meeting as MOVA's `train()` starts: the ranks end model loading and FSDP wrapping over a
      second apart here, and the data loader's first batch synchronises RNG states with a
      broadcast on the default group (a LoRA attempt in CI timed out there, not in a save).
      Startup skew is not what the reporter's 1,800 s measured."""
    import datetime

    import accelerate
    import mova.utils.adapter as adapter
    import torch.distributed as dist
    from mova.engine.trainer.accelerate import accelerate_trainer

    group = {}
    original_init = adapter.init_distributed_adapter

    def init_distributed_adapter():
        original_init()
        group["training"] = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=training_timeout_s))
    adapter.init_distributed_adapter = init_distributed_adapter
    original_accelerator_init = accelerate.Accelerator.__init__

    def __init__(self, *args, **kwargs):
        with whole_world_meshes_on(group["training"]):
            original_accelerator_init(self, *args, **kwargs)
        fsdp_group = self.torch_device_mesh["dp_shard_cp"].get_group()
        if fsdp_group is not group["training"]:
            raise RuntimeError(f"FSDP's mesh is on group {fsdp_group.group_name}, not the training group: "
                               "torch's DeviceMesh no longer takes its whole-world group from _get_default_group")
    accelerate.Accelerator.__init__ = __init__
    original_save = accelerate_trainer.AccelerateTrainer._save_checkpoint

    def _save_checkpoint(self, *args, **kwargs):
        dist.barrier(group=group["training"])
        return original_save(self, *args, **kwargs)
    accelerate_trainer.AccelerateTrainer._save_checkpoint = _save_checkpoint
    original_train = accelerate_trainer.AccelerateTrainer.train

    def train(self):
        dist.barrier(group=group["training"])
        return original_train(self)
    accelerate_trainer.AccelerateTrainer.train = train


@contextlib.contextmanager
def whole_world_meshes_on(group):
    """DeviceMesh dimensions over every rank use `group` instead of the default group (torch 2.8
    and 2.14 both take that group from device_mesh._get_default_group; the caller checks)."""
    from torch.distributed import device_mesh

    original = device_mesh._get_default_group
    device_mesh._get_default_group = lambda: group
    try:
        yield
    finally:
        device_mesh._get_default_group = original


def freeze_setup_objects_before_movas_training() -> None:
    """worker.freeze_setup_objects() as MOVA's `AccelerateTrainer.train` starts (a pass-through)."""
    from mova.engine.trainer.accelerate import accelerate_trainer

    from ..worker import freeze_setup_objects

    original = accelerate_trainer.AccelerateTrainer.train

    def train(self):
        freeze_setup_objects()
        return original(self)
    accelerate_trainer.AccelerateTrainer.train = train


def roundtrip_after_movas_training(outcome: dict) -> None:
    """After MOVA's `train()` returns (its last act is the final save), snapshot this rank's model
    and optimizer state, overwrite it, resume from that "final" checkpoint through MOVA's own
    `_resume_checkpoint` (patched: `ScalableCheckpointing.load_state`) and compare bit for bit.
    The differing keys land in `outcome["differences"]` (a pass-through wrapper)."""
    from mova.engine.trainer.accelerate import accelerate_trainer

    from ..roundtrip import differences, local_state, scramble

    original = accelerate_trainer.AccelerateTrainer.train

    def train(self):
        from ckptdoctor.fix.checkpointing import OWNER

        result = original(self)
        before = local_state(self.model, self.optimizer)
        scramble(self.model, self.optimizer)
        owner = getattr(self.accelerator, OWNER, None)
        if owner is not None:  # async: "final" may still be in flight; MOVA's own resume (at startup) asks latest()
            owner.wait()
        self._resume_checkpoint(os.path.join(self.save_path, "final"))
        outcome["differences"] = differences(before, local_state(self.model, self.optimizer))
        return result
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
                Path(results_dir, "fault_thread").write_text(threading.current_thread().name)  # async: the background
                if fault["kind"] == "sigstop":
                    Path(results_dir, FROZEN_PID).write_text(str(os.getpid()))  # for run_mova's teardown
                    os.kill(os.getpid(), signal.SIGSTOP)
                else:
                    os._exit(9)
        return original(planner)

    DefaultSavePlanner.create_local_plan = create_local_plan


def without_harness(frames: list[dict]) -> list[dict]:
    """The frames MOVA's code and its libraries made: this module's own (`main` and the
    pass-through wrappers around `train` and `_save_checkpoint`) are not the reporter's chain."""
    return [f for f in frames if Path(f["file"]).resolve() != Path(__file__).resolve()]


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
    training_group_for_fsdp_and_movas_saves(spec.training_timeout_s)
    freeze_setup_objects_before_movas_training()
    from . import pipeline  # noqa: F401 - registers TinyMOVATrain and TinyVideoAudioDataset in MOVA's registries

    probe = SaveProbe(rank).install(time_collectives=spec.time_collectives)
    report = RankReport(spec.results_dir, rank, probe)
    keep_evidence_on_sigterm(report)
    if spec.fault:
        arm_fault(spec.fault, rank, spec.results_dir, probe)
    roundtrip = {}
    if spec.roundtrip:
        roundtrip_after_movas_training(roundtrip)
    sys.argv = [str(Path(spec.extract) / TRAIN_SCRIPT), spec.config]
    os.chdir(spec.extract)
    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
    except BaseException as error:
        report.write(status="failed", error_type=type(error).__name__, error=str(error).strip()[-4000:],
                     error_time_s=time.time(), frames=without_harness(frames_of(error.__traceback__)),
                     losses=_losses())
        raise
    report.write(status="ok", losses=_losses(), rng_digests=_rng_digests(),
                 roundtrip_differences=roundtrip.get("differences"))
    return 0


def _losses() -> list[float]:
    from .pipeline import TinyMOVATrain

    return list(TinyMOVATrain.last_losses)


def _rng_digests() -> list[int]:
    from .pipeline import TinyMOVATrain

    return list(TinyMOVATrain.rng_digests)


if __name__ == "__main__":
    sys.exit(main())

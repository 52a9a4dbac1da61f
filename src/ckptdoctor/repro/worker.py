"""One rank of a training job: `python -m ckptdoctor.repro.worker SPEC.json` (started by the launcher).

The default process group stands for the gloo half of the reporter's "cpu:gloo,npu:hccl"
group and carries the checkpoint deadline; FSDP trains on a second gloo group with the
training timeout (see training_group.py). Each rank writes `rank<N>.json` with its outcome,
the frames of any exception, and its DCP step events, then lets the exception escape so
torch's excepthook prints the `[rankN]:` traceback as in the report.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import signal
import sys
import time
import traceback
from pathlib import Path

from .config import CHECKPOINT_TIMEOUT_FACTOR, TrainingConfig
from ..check.mova_shape import MovaShape


@dataclasses.dataclass
class WorkerSpec:
    config: TrainingConfig
    shape: MovaShape
    output_dir: str
    results_dir: str
    checkpoint_deadline_s: float
    training_timeout_s: float = 1800.0
    fix: bool = False
    roundtrip: bool = True          # with fix: each save is loaded back in place and compared (roundtrip.FixedSave)
    resume_step: int | None = None  # load step-<N>/accelerator from output_dir (with the fix) before training
    # Time gloo operations (calibration). Off in the reproduction itself, so that its
    # tracebacks hold torch's and Accelerate's frames only, as the report's do.
    time_collectives: bool = False

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> "WorkerSpec":
        raw = json.loads(text)
        raw["config"] = TrainingConfig(**raw["config"])
        raw["shape"] = MovaShape(**raw["shape"])
        return cls(**raw)


def frames_of(tb) -> list[dict]:
    """Frames of a traceback or stack summary, outermost first."""
    summary = tb if isinstance(tb, traceback.StackSummary) else traceback.extract_tb(tb)
    return [{"function": f.name, "file": f.filename, "line": f.lineno} for f in summary]


class RankReport:
    """Accumulates what this rank saw and writes it as JSON, even when killed."""

    def __init__(self, results_dir: str, rank: int, probe):
        self.path = Path(results_dir) / f"rank{rank}.json"
        self.data = {"rank": rank, "status": "running", "started_s": time.time()}
        self.probe = probe

    def write(self, **fields) -> None:
        self.data.update(fields, ended_s=time.time(),
                         events=[dataclasses.asdict(e) for e in self.probe.events],
                         calls=[dataclasses.asdict(c) for c in self.probe.calls], plans=self.probe.plans)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1))
        os.replace(tmp, self.path)


def keep_evidence_on_sigterm(report: RankReport) -> None:
    """The launcher tears the job down with SIGTERM: write where this rank was, then exit."""
    def on_sigterm(signum, frame):
        report.write(status="terminated", frames=frames_of(traceback.extract_stack(frame)))
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, on_sigterm)


def freeze_setup_objects() -> None:
    """`gc.freeze()` once, after the trainer is set up and before it trains: the objects that exist
    then (the imports of torch, Accelerate and, for MOVA, diffusers, transformers, mmengine; the
    model; the optimizer) are exempt from later cyclic collections, which still run on everything
    made afterwards. Why: eight processes share two cores here. Right after a save, the seven peers
    unpickle the metadata rank 0 broadcast, and each full collection they trigger walks millions of
    setup objects; serialised on two cores this made the peers 2.1-2.5 s late for the next save's
    plan gather (MOVA sft, 24 blocks), where rank 0 waits for them under the scaled deadline, instead
    of 0.8-1.3 s with the freeze, while rank 0's planning (3.3-4.0 s) did not change
    (docs/evidence/repro_separation.txt). On the cluster every rank has its own cores. DCP's work is
    untouched; only what the collector walks is."""
    import gc

    gc.collect()
    gc.freeze()


def rendezvous(rank: int, timeout_s: float):
    """A TCP store every rank has reached, so that a short checkpoint deadline (the group's
    timeout) does not also bound process start-up: 8 interpreters importing torch on 2
    cores arrive seconds apart, and the group's timeout would otherwise cover the store
    connection and gloo's own connect."""
    import torch.distributed as dist

    world = int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, rank == 0,
                          timeout=datetime.timedelta(seconds=timeout_s))
    store.add("ckptdoctor/arrived", 1)
    deadline = time.monotonic() + timeout_s
    while store.add("ckptdoctor/arrived", 0) < world:
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank {rank}: not every rank reached the store within {timeout_s:.0f} s")
        time.sleep(0.01)
    return store


def run(spec: WorkerSpec) -> int:
    import torch
    import torch.distributed as dist

    from .probes import SaveProbe
    from .trainer import AccelerateTrainer

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    store = rendezvous(rank, spec.training_timeout_s)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=int(os.environ["WORLD_SIZE"]),
                            timeout=datetime.timedelta(seconds=spec.checkpoint_deadline_s))
    # FSDP gets its own group (the HCCL half on NPU) unless the mesh has a context-parallel
    # dimension, which Accelerate must build itself: then training shares the default group.
    training_group = None if spec.config.cp_size > 1 else dist.new_group(
        backend="gloo", timeout=datetime.timedelta(seconds=spec.training_timeout_s))
    report = RankReport(spec.results_dir, rank, SaveProbe(rank).install(time_collectives=spec.time_collectives))

    keep_evidence_on_sigterm(report)
    save_hook = None
    if spec.fix:  # the default group keeps the scaled deadline; saves move to their own group
        from .roundtrip import FixedSave
        save_hook = FixedSave(checkpoint_timeout_s=spec.checkpoint_deadline_s * CHECKPOINT_TIMEOUT_FACTOR,
                              roundtrip=spec.roundtrip)
    try:
        trainer = AccelerateTrainer(spec.config, spec.shape, spec.output_dir, training_group, save_hook)
        if spec.resume_step is not None:
            resume(trainer, spec, save_hook)
        freeze_setup_objects()
        result = trainer.train()
    except BaseException as error:
        report.write(status="failed", error_type=type(error).__name__, error=str(error).strip(),
                     error_time_s=time.time(), frames=frames_of(error.__traceback__))
        raise
    roundtrip = None if save_hook is None else save_hook.roundtrip_differences
    report.write(status="ok", losses=result.losses, saved_steps=result.saved_steps, roundtrip_differences=roundtrip)
    dist.destroy_process_group()
    return 0


def resume(trainer, spec: WorkerSpec, save_hook) -> None:
    """Continue from a published checkpoint, as MOVA's _resume_checkpoint would with the fix."""
    from ..fix.checkpointing import ScalableCheckpointing

    checkpointing = ScalableCheckpointing(trainer.accelerator,
                                          timeout_s=spec.checkpoint_deadline_s * CHECKPOINT_TIMEOUT_FACTOR)
    checkpointing.load_state(trainer.step_dir(spec.resume_step) / "accelerator")
    trainer.step = spec.resume_step
    if save_hook is not None:
        save_hook.checkpointing = checkpointing


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    return run(WorkerSpec.from_json(Path(argv[0]).read_text()))


if __name__ == "__main__":
    sys.exit(main())

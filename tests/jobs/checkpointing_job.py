"""One rank of a ScalableCheckpointing fault test (started by tests/fix/test_checkpointing.py).

    python checkpointing_job.py OUT FAULT [RANK]

A stand-in accelerator saves the way Accelerate 1.13's save_state does (a DCP save per model
and optimizer with FileSystemWriter(dir) and DefaultSavePlanner(), then per-rank random
states), so ScalableCheckpointing is exercised on real gloo ranks without an FSDP model.
FAULT (what the test injects; ScalableCheckpointing's defences are under test):
    none         one save, published
    installed    ckptdoctor.install(accelerator), then the accelerator's own save_state and load_state
    double       both integrations on one Accelerator, in each order (install first; ScalableCheckpointing first)
    differ       rank RANK's model holds a key the others do not: rank 0 cannot derive the save, which
                 takes the owned path by the planner's agreement; then loaded back
    planner      the accelerator passes its own SavePlanner subclass: refused, nothing published
    settings     rank RANK's environment says CKPTDOCTOR_PUBLISH=in_place, the others' rename
    sigstop      rank RANK stops itself (SIGSTOP) in its local plan, as a node that vanished
    exit         rank RANK exits (os._exit) in its local plan
    gil          rank RANK's main thread holds the GIL for HOLD_GIL_S seconds in its local plan
                 (busy, not lost: a long pickle or native call), then the save goes on
    bound        the accelerator's dcp.save was bound before ckptdoctor could wrap it
    blind        rank RANK does not see the newest checkpoint (a stale NFS view), at resume
    load-only    load_state of OUT/ckpt/step-1/accelerator, which another job (another torch) saved
    loads        for each of LOAD_PROBLEMS in turn: one step saved in its own root (OUT/ckpt/PROBLEM),
                 damaged by rank 0, loaded back with load_state; outcomes in report["loads"][PROBLEM]
(a race of two jobs publishing one step: two "none" jobs with CKPTDOCTOR_TEST_CKPT_ROOT shared, ordered by
 TEST_HOLD=before-save (made, then waits for OUT/go before saving) or before-publish (written, then waits))
Each rank writes OUT/rank<N>.json: what happened, when.
"""

import datetime
import errno
import json
import os
import pickle
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemWriter
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from ckptdoctor.fix.checkpointing import ScalableCheckpointing
from ckptdoctor.fix.install import install

BOUND_SAVE = dcp.save  # what a module that did `from torch.distributed.checkpoint import save` holds


class StandInAccelerator:
    """save_state/load_state with Accelerate 1.13's DCP calls (fsdp_utils.py), on a tiny state."""

    def __init__(self, bound: bool = False):
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        self.model = {"w": distribute_tensor(torch.arange(40.0).reshape(8, 5), mesh, [Shard(0)]), "b": torch.ones(3)}
        self.optim = {"state": {"w": {"step": torch.tensor(2.0)}}, "param_groups": [{"lr": 1e-4}]}
        self.save = BOUND_SAVE if bound else None
        self.planner = None  # Accelerate passes DefaultSavePlanner(); a subclass is another planner

    def save_state(self, output_dir: str) -> None:
        save = self.save or dcp.save  # looked up at call time, as Accelerate does
        for name, state in (("pytorch_model_fsdp_0", {"model": self.model}), ("optimizer_0", {"optimizer": self.optim})):
            ckpt = Path(output_dir) / name
            ckpt.mkdir(parents=True, exist_ok=True)
            save(state_dict=state, storage_writer=FileSystemWriter(ckpt), planner=self.planner or DefaultSavePlanner())
        with open(Path(output_dir) / f"random_states_{dist.get_rank()}.pkl", "wb") as f:
            pickle.dump({"seed": 1}, f)

    def load_state(self, input_dir: str) -> None:
        """As Accelerate's: FileSystemReader(dir) and DefaultLoadPlanner() for the model, no planner for the
        optimizer; the state is zeroed first, so a load that skipped an item shows."""
        self.model["w"].to_local().zero_(), self.model["b"].zero_()
        self.optim["state"]["w"]["step"].zero_()
        dcp.load({"model": self.model}, storage_reader=dcp.FileSystemReader(Path(input_dir) / "pytorch_model_fsdp_0"),
                 planner=dcp.DefaultLoadPlanner())
        dcp.load({"optimizer": self.optim}, checkpoint_id=Path(input_dir) / "optimizer_0",
                 storage_reader=dcp.FileSystemReader(Path(input_dir) / "optimizer_0"))

    def state_is_the_saved_one(self) -> bool:
        expected = StandInAccelerator().model
        return torch.equal(self.model["w"].to_local(), expected["w"].to_local()) and \
            torch.equal(self.model["b"], expected["b"]) and self.optim["state"]["w"]["step"].item() == 2.0


class OwnPlanner(DefaultSavePlanner):
    """A planner of a trainer's own (a subclass): its save would not be the fix's."""


def damage(state_dir: Path, problem: str) -> None:
    """Rank 0 breaks a published checkpoint the way a user's disk or code would."""
    model = state_dir / "pytorch_model_fsdp_0"
    if problem == "missing-metadata":
        (model / ".metadata").unlink()
    elif problem == "truncated-metadata":
        (model / ".ckptdoctor-index").unlink(missing_ok=True)
        data = (model / ".metadata").read_bytes()
        (model / ".metadata").write_bytes(data[:len(data) // 2])
    elif problem == "data-file-missing":
        (model / "__1_0.distcp").unlink()
    elif problem == "empty-index":  # an interrupted copy
        (model / ".ckptdoctor-index").write_bytes(b"")


# none: ours; stock: saved by stock save_state (no marker, no index); empty-index: an interrupted copy of the
# index; missing-metadata, truncated-metadata (and no index), data-file-missing; misspelt: published with
# begin/commit, loaded from a subdirectory it lacks; extra-key (last: the model keeps a key the checkpoints lack)
LOAD_PROBLEMS = ("none", "stock", "empty-index", "missing-metadata", "truncated-metadata", "data-file-missing",
                 "misspelt", "extra-key")


def every_load_problem(ckpt, accelerator, root: Path, report: dict) -> None:
    """One launch serves every load problem: each rank goes on to the next after a refusal, as a
    trainer that caught it would (which also shows a refused load leaves the checkpointing usable)."""
    report["loads"] = {}
    for problem in LOAD_PROBLEMS:
        outcome = report["loads"][problem] = {}
        try:
            save_then_load(ckpt, accelerator, root / problem, problem, outcome)
            outcome["status"] = "ok"
        except Exception as error:  # noqa: BLE001 - reported for the test
            outcome.update(status="failed", error_type=type(error).__name__, error=str(error)[-1500:])


def save_then_load(ckpt, accelerator, root: Path, problem: str, report: dict) -> None:
    state_dir = root / "step-1" / "accelerator"
    if problem == "stock":
        accelerator.save_state(str(state_dir))  # stock save_state: no marker, no index
    elif problem == "misspelt":  # a step published with begin/commit, then loaded from a subdirectory it lacks
        staging = ckpt.begin(root / "step-1")
        ckpt.save_state(staging / "accelerator")
        ckpt.commit(staging)
        state_dir = root / "step-1" / "acelerator"
    else:
        ckpt.save_state(state_dir)
    if dist.get_rank() == 0:
        damage(state_dir, problem)
    dist.barrier()
    if problem == "extra-key":
        accelerator.model["extra"] = torch.zeros(2)
    start = time.time()
    try:
        ckpt.load_state(state_dir)
    finally:
        report["load_s"] = time.time() - start
    report["state_is_the_saved_one"] = accelerator.state_is_the_saved_one()
    report["indexed"] = sorted(p.parent.name for p in state_dir.glob("*/.ckptdoctor-index"))


def hold_the_gil(seconds: float) -> None:
    """Pure Python with a switch interval longer than the hold: no other thread of this
    process (the heartbeat thread) runs until it ends."""
    sys.setswitchinterval(seconds * 10)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass
    sys.setswitchinterval(0.005)


def stop_in_planning(rank: int, how: str) -> None:
    original = DefaultSavePlanner.create_local_plan

    def create_local_plan(self):
        if dist.get_rank() == rank:
            Path(OUT, "fault_at").write_text(repr(time.time()))
            if how == "sigstop":
                os.kill(os.getpid(), signal.SIGSTOP)
            elif how == "gil":
                hold_the_gil(float(os.environ["HOLD_GIL_S"]))
            else:
                os._exit(9)
        return original(self)
    DefaultSavePlanner.create_local_plan = create_local_plan


def hold_at(point: str) -> None:
    """Rank 0 says this job reached `point` (OUT/<point>); every rank waits for the test's OUT/go."""
    if dist.get_rank() == 0:
        Path(OUT, point).write_text(repr(time.time()))
    deadline = time.monotonic() + 120
    while not Path(OUT, "go").exists() and time.monotonic() < deadline:
        time.sleep(0.05)


def refused(work) -> str:
    try:
        work()
    except Exception as error:  # noqa: BLE001 - the one line is the test's subject
        return f"{type(error).__name__}: {error}"
    return "accepted"


def construction_only(fault: str, target: int, accelerator, root: Path, report: dict) -> int:
    """The checks made when the fix is set up, before anything is written."""
    if fault == "double":
        install(accelerator)
        report["install_then_patch"] = refused(lambda: ScalableCheckpointing(accelerator))
        other = StandInAccelerator()
        ScalableCheckpointing(other)
        report["patch_then_install"] = refused(lambda: install(other))
        report["still_saves"] = str(accelerator.save_state(str(root / "step-1" / "accelerator")))
    else:
        if dist.get_rank() == target:
            os.environ["CKPTDOCTOR_PUBLISH"] = "in_place"  # this node's environment differs
        report["construction"] = refused(lambda: ScalableCheckpointing(accelerator))
        report["written"] = sorted(str(p.relative_to(root)) for p in root.rglob("*")) if root.exists() else []
    report["status"], report["end_s"] = "ok", time.time()
    Path(OUT, f"rank{dist.get_rank()}.{os.getpid()}.json").write_text(json.dumps(report))
    dist.destroy_process_group()
    return 0


def main() -> int:
    global OUT
    OUT, fault = Path(sys.argv[1]), sys.argv[2]
    root = Path(os.environ.get("CKPTDOCTOR_TEST_CKPT_ROOT", OUT / "ckpt"))
    target = int(sys.argv[3]) if len(sys.argv) > 3 else -1
    if (OUT / "full").is_dir():  # the test mounted a full filesystem there (a real ENOSPC)
        root = OUT / "full" / "ckpt"
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    rank = dist.get_rank()
    report = {"rank": rank, "fault": fault}
    accelerator = StandInAccelerator(bound=fault == "bound")
    if os.environ.get("TEST_HOLD") == "before-publish":  # Accelerate's save_state as ScalableCheckpointing will keep it
        save_state = accelerator.save_state
        accelerator.save_state = lambda directory: (save_state(directory), hold_at("written"))[0]
    if fault in ("double", "settings"):
        return construction_only(fault, target, accelerator, root, report)
    # its timeout and lost-rank window: from the test's environment
    ckpt = install(accelerator) if fault == "installed" else ScalableCheckpointing(accelerator)
    report["settings"] = {"timeout_s": ckpt.settings.timeout_s, "lost_rank_s": ckpt.settings.lost_rank_s,
                          "on_lost_rank": ckpt.settings.on_lost_rank, "publish": ckpt.settings.publish}
    try:
        if fault in ("sigstop", "exit", "gil"):
            stop_in_planning(target, fault)
        if fault == "blind":
            ckpt.save_state(root / "step-1" / "accelerator")
            ckpt.save_state(root / "step-2" / "accelerator")
            if rank == target:  # this host's view lags: the newest step is not complete to it
                from ckptdoctor.fix import publish as publishing
                real = publishing.counts_as_checkpoint
                publishing.counts_as_checkpoint = lambda p, *a: False if "step-2" in str(p) else real(p, *a)
            report["resumed_from"] = str(ckpt.latest(root, "accelerator"))
        elif fault == "marker-fails":  # INJECTED: rank 0's completion marker hits ENOSPC after the rename
            if rank == 0:
                from ckptdoctor.fix import publish as publishing
                write_durably = publishing._write_durably

                def full_disk(path, data):
                    if path.name == publishing.COMPLETE_MARKER:
                        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                    write_durably(path, data)
                publishing._write_durably = full_disk
            report["published"] = str(ckpt.save_state(root / "step-1" / "accelerator"))
        elif fault == "installed":  # the minimal integration: the accelerator's own methods, after install()
            report["install_twice_same"] = install(accelerator) is ckpt
            step = root / "step-1" / "accelerator"
            report["returned"] = accelerator.save_state(str(step))
            accelerator.load_state(str(step))  # zeroes the state first, then loads
            report["state_is_the_saved_one"] = accelerator.state_is_the_saved_one()
            try:
                accelerator.save_state()
            except Exception as error:  # noqa: BLE001 - the one line is the test's subject
                report["no_dir"] = f"{type(error).__name__}: {error}"
        elif fault == "differ":
            if rank == target:
                accelerator.model["only_here"] = torch.full((2,), 7.0)
            step = root / "step-1" / "accelerator"
            report["published"] = str(ckpt.save_state(step))
            if rank == target:
                accelerator.model["only_here"].zero_()
            ckpt.load_state(step)
            report["state_is_the_saved_one"] = accelerator.state_is_the_saved_one() and (
                rank != target or torch.equal(accelerator.model["only_here"], torch.full((2,), 7.0)))
        elif fault == "planner":
            accelerator.planner = OwnPlanner()
            report["published"] = str(ckpt.save_state(root / "step-1" / "accelerator"))
        elif fault == "load-only":
            ckpt.load_state(root / "step-1" / "accelerator")
            report["state_is_the_saved_one"] = accelerator.state_is_the_saved_one()
        elif fault == "loads":
            every_load_problem(ckpt, accelerator, root, report)
        else:
            if os.environ.get("TEST_HOLD") == "before-save":  # the two-jobs race, ordered by the test
                hold_at("ready")
            report["published"] = str(ckpt.save_state(root / "step-1" / "accelerator"))
            report["latest"] = str(ckpt.latest(root, "accelerator"))
        report["status"] = "ok"
    except BaseException as error:  # noqa: BLE001 - reported for the test
        report.update(status="failed", error_type=type(error).__name__, error=str(error)[-1500:])
    report["end_s"] = time.time()
    Path(OUT, f"rank{rank}.{os.getpid()}.json").write_text(json.dumps(report))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main()
    # The report is written and the groups destroyed. After a failed save, the newest torch's gloo
    # worker threads have once aborted interpreter finalization here ("terminate called without an
    # active exception", CI; cf. pytorch/pytorch#190489), so leave without finalizing.
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(code)

"""One call in a training script: Accelerate's save_state/load_state with the fix.

    from ckptdoctor import ScalableCheckpointing
    ckpt = ScalableCheckpointing(accelerator, timeout_s=3 * 3600)   # after accelerator.prepare
    ckpt.save_state(step_dir / "accelerator")                         # instead of accelerator.save_state
    ckpt.load_state(ckpt.latest(output_dir, "accelerator"))           # instead of accelerator.load_state

What it changes, and nothing else:
* a checkpoint process group (gloo, its own timeout): DCP's plan exchange, finish step and
  our barriers run there, so the training group's deadline can stay short and a long save
  cannot trip it;
* `ScalableSavePlanner` instead of the `DefaultSavePlanner()` Accelerate passes, and
  `ScalableFileSystemWriter` instead of its `FileSystemWriter(path)` (same files, a finish
  step without one Python object per chunk);
* atomic publication: the state is written to `<dir>.incomplete`, and only after every
  rank has written and rank 0's metadata is complete is it renamed to `<dir>`; `latest()`
  ignores anything else, so an interrupted save is never resumed from.

How: Accelerate calls `torch.distributed.checkpoint.save/load` with a fixed planner and no
process group. For the duration of one save_state/load_state call only, those two module
attributes are wrapped (pass-through to torch's own functions, adding `process_group` and
swapping the stock planner and writer). Checked against the versions pinned in this project; the
checkpoint layout stays Accelerate's own (`pytorch_model_fsdp_0/`, `optimizer_0/`, ...).
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import os
import shutil
import threading
import time
from pathlib import Path

from ..errors import CkptDoctorError
from .compat import check_versions
from .planner import ScalableSavePlanner
from .storage import ScalableFileSystemWriter

INCOMPLETE = ".incomplete"
COMPLETE_MARKER = "CKPTDOCTOR_COMPLETE"
PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Connection refused")
HEARTBEAT_S = 1.0  # during a save each rank bumps a store counter this often


class CheckpointAborted(CkptDoctorError):
    """A save or load could not finish on every rank."""


class ScalableCheckpointing:
    """Owns the checkpoint group; saves and loads through Accelerate with the fix."""

    def __init__(self, accelerator, timeout_s: float = 3 * 3600.0, group=None):
        import torch.distributed as dist

        check_versions()
        self.accelerator = accelerator
        self.group = group or dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
        self.rank = dist.get_rank()
        self._prefix = "ckptdoctor/ckpt/load/"

    # -- save / load ------------------------------------------------------------------
    def save_state(self, output_dir: str | os.PathLike) -> Path:
        final = Path(output_dir)
        self._prefix = f"ckptdoctor/ckpt/{final.parent.name}/{final.name}/"
        staging = final.with_name(final.name + INCOMPLETE)
        with Heartbeat(self._prefix, self.rank):
            if self.rank == 0:
                shutil.rmtree(staging, ignore_errors=True)  # a previous interrupted attempt
            self._barrier("clean staging")
            with self._dcp_on_checkpoint_group():
                self.accelerator.save_state(str(staging))
            self._barrier("every rank wrote")  # rank 0's metadata is written before it gets here
            if self.rank == 0:
                (staging / COMPLETE_MARKER).write_text("ok\n")
                if final.exists():
                    shutil.rmtree(final)
                os.replace(staging, final)
            self._barrier("published")
        return final

    def load_state(self, input_dir: str | os.PathLike) -> None:
        path = Path(input_dir)
        if not is_complete(path):
            raise CheckpointAborted(f"{path} is not a complete checkpoint (no {COMPLETE_MARKER}); refusing to load it")
        with Heartbeat(self._prefix, self.rank), self._dcp_on_checkpoint_group():
            self.accelerator.load_state(str(path))

    @staticmethod
    def latest(root: str | os.PathLike, subdir: str = "accelerator") -> Path | None:
        """The newest `root/<step>/<subdir>` that was published complete (None if none)."""
        candidates = [d / subdir for d in Path(root).iterdir() if d.is_dir() and is_complete(d / subdir)] \
            if Path(root).is_dir() else []
        return max(candidates, key=lambda p: _step_number(p.parent), default=None)

    # -- internals ----------------------------------------------------------------------
    def _barrier(self, what: str) -> None:
        import torch.distributed as dist

        try:
            dist.barrier(group=self.group)
        except RuntimeError as error:
            raise self._aborted(f"at '{what}'", error) from error

    def _aborted(self, where: str, error: Exception) -> CheckpointAborted:
        """Name the ranks that left, from their heartbeats on the job's TCP store."""
        missing = ranks_gone(self._prefix, self.rank, self.accelerator.num_processes)
        who = f"rank(s) {', '.join(map(str, missing))} left the checkpoint" if missing else "a peer left the checkpoint"
        return CheckpointAborted(f"rank {self.rank}: checkpoint aborted {where}: {who} ({str(error).strip()[:200]})")

    @contextlib.contextmanager
    def _dcp_on_checkpoint_group(self):
        """For one call: Accelerate's dist_cp.save/load run on the checkpoint group, saves
        with ScalableSavePlanner. Restored on exit, also on error."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemWriter

        original_save, original_load = dcp.save, dcp.load
        group = self.group

        @functools.wraps(original_save)
        def save(*args, planner=None, process_group=None, storage_writer=None, **kwargs):
            if planner is None or type(planner) is DefaultSavePlanner:
                planner = ScalableSavePlanner(process_group=group)
            if type(storage_writer) is FileSystemWriter:  # a subclass without state of its own: same settings
                storage_writer.__class__ = ScalableFileSystemWriter
            return original_save(*args, planner=planner, process_group=process_group or group,
                                 storage_writer=storage_writer, **kwargs)

        @functools.wraps(original_load)
        def load(*args, process_group=None, **kwargs):
            return original_load(*args, process_group=process_group or group, **kwargs)

        dcp.save, dcp.load = save, load
        try:
            yield
        except RuntimeError as error:  # DCP wraps per-rank failures in CheckpointException (a RuntimeError)
            if any(sign in str(error) for sign in PEER_GONE):
                raise self._aborted("during DCP", error) from error
            raise
        finally:
            dcp.save, dcp.load = original_save, original_load


def job_store():
    """The job's TCP store (torch keeps it privately; 2.8 and 2.14 expose it the same way)."""
    import torch.distributed as dist

    return dist.distributed_c10d._get_default_store()


class Heartbeat:
    """While a save or load runs, a daemon thread bumps this rank's counter on the job's TCP
    store every `interval_s` (a key update, not a collective). A rank whose counter stops is gone."""

    def __init__(self, prefix: str, rank: int, interval_s: float = HEARTBEAT_S):
        self.key, self.interval_s = f"{prefix}beat/{rank}", interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="ckptdoctor-heartbeat", daemon=True)

    def _beat(self) -> None:
        try:
            store = job_store()
            while True:
                store.add(self.key, 1)
                if self._stop.wait(self.interval_s):
                    return
        except Exception:  # noqa: BLE001 - the store went away with rank 0: nothing to report to
            return

    def __enter__(self) -> "Heartbeat":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()


def ranks_gone(prefix: str, rank: int, world_size: int, wait_s: float = 3 * HEARTBEAT_S) -> list[int]:
    """Ranks whose heartbeat stopped and who did not abort on their own (a survivor that gave
    up first marks itself), watched for `wait_s`. The store lives in rank 0's process: when
    it is unreachable, rank 0 is gone."""
    try:
        store = job_store()
        store.set(f"{prefix}aborted/{rank}", "1")
        keys = [f"{prefix}beat/{r}" for r in range(world_size)]
        before = [store.add(k, 0) for k in keys]
        time.sleep(wait_s)
        after = [store.add(k, 0) for k in keys]
        return [r for r in range(world_size) if r != rank and after[r] == before[r]
                and not store.check([f"{prefix}aborted/{r}"])]
    except Exception:  # noqa: BLE001
        return [0] if rank != 0 else []


def local_adapter_state(model, marker: str = "lora_") -> dict:
    """The adapter (LoRA) weights straight from this rank's parameters, without a gather.

    MOVA gathers the whole model to rank 0 (`accelerator.get_state_dict`) to pick these out.
    FSDP-ignored LoRA parameters are plain, full tensors, identical on every rank (their
    gradients are averaged), so rank 0 can save its own copy. Refuses sharded parameters."""
    state = {}
    for name, param in model.named_parameters():
        if marker in name:
            if hasattr(param, "placements"):
                raise CkptDoctorError(f"{name} is sharded by FSDP (not an ignored module): it needs a gather")
            state[name] = param.detach().cpu().clone()
    if not state:
        raise CkptDoctorError(f"no parameter name contains {marker!r}")
    return state


def is_complete(path: Path) -> bool:
    return (path / COMPLETE_MARKER).is_file() and not path.name.endswith(INCOMPLETE)


def _step_number(path: Path) -> int:
    digits = "".join(ch for ch in path.name if ch.isdigit())
    return int(digits) if digits else -1

"""One call in a training script: Accelerate's save_state/load_state with the fix.

    from ckptdoctor.checkpointing import ScalableCheckpointing
    ckpt = ScalableCheckpointing(accelerator, timeout_s=3 * 3600)   # after accelerator.prepare
    ckpt.save_state(step_dir / "accelerator")                         # instead of accelerator.save_state
    ckpt.load_state(ckpt.latest(output_dir, "accelerator"))           # instead of accelerator.load_state

What it changes, and nothing else:
* a checkpoint process group (gloo, its own timeout): DCP's plan exchange, finish step and
  our barriers run there, so the training group's deadline can stay short and a long save
  cannot trip it;
* `ScalableSavePlanner` instead of the `DefaultSavePlanner()` Accelerate passes;
* atomic publication: the state is written to `<dir>.incomplete`, and only after every
  rank has written and rank 0's metadata is complete is it renamed to `<dir>`; `latest()`
  ignores anything else, so an interrupted save is never resumed from.

How: Accelerate calls `torch.distributed.checkpoint.save/load` with a fixed planner and no
process group. For the duration of one save_state/load_state call only, those two module
attributes are wrapped (pass-through to torch's own functions, adding `process_group` and
swapping the stock planner). Checked against the versions pinned in this project; the
checkpoint layout stays Accelerate's own (`pytorch_model_fsdp_0/`, `optimizer_0/`, ...).
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import os
import shutil
from pathlib import Path

from .errors import CkptDoctorError, UnsupportedVersion
from .planner import ScalableSavePlanner

CHECKED = {"torch": ("2.8.0", "2.14.1"), "accelerate": ("1.13.0", "1.15.0")}
INCOMPLETE = ".incomplete"
COMPLETE_MARKER = "CKPTDOCTOR_COMPLETE"


class CheckpointAborted(CkptDoctorError):
    """A save or load could not finish on every rank."""


def check_versions() -> None:
    from .stacks import installed_versions

    torch_v, accelerate_v = installed_versions()
    if torch_v not in CHECKED["torch"] or accelerate_v not in CHECKED["accelerate"]:
        raise UnsupportedVersion(f"ScalableCheckpointing is checked on torch {'/'.join(CHECKED['torch'])} and "
                                 f"accelerate {'/'.join(CHECKED['accelerate'])}, not torch {torch_v} / "
                                 f"accelerate {accelerate_v}")


class ScalableCheckpointing:
    """Owns the checkpoint group; saves and loads through Accelerate with the fix."""

    def __init__(self, accelerator, timeout_s: float = 3 * 3600.0, group=None):
        import torch.distributed as dist

        check_versions()
        self.accelerator = accelerator
        self.group = group or dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
        self.rank = dist.get_rank()

    # -- save / load ------------------------------------------------------------------
    def save_state(self, output_dir: str | os.PathLike) -> Path:
        final = Path(output_dir)
        staging = final.with_name(final.name + INCOMPLETE)
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
        with self._dcp_on_checkpoint_group():
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
            raise CheckpointAborted(f"rank {self.rank}: checkpoint aborted at '{what}': a peer left the "
                                    f"checkpoint group ({error})") from error

    @contextlib.contextmanager
    def _dcp_on_checkpoint_group(self):
        """For one call: Accelerate's dist_cp.save/load run on the checkpoint group, saves
        with ScalableSavePlanner. Restored on exit, also on error."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import DefaultSavePlanner

        original_save, original_load = dcp.save, dcp.load
        group = self.group

        @functools.wraps(original_save)
        def save(*args, planner=None, process_group=None, **kwargs):
            if planner is None or type(planner) is DefaultSavePlanner:
                planner = ScalableSavePlanner(process_group=group)
            return original_save(*args, planner=planner, process_group=process_group or group, **kwargs)

        @functools.wraps(original_load)
        def load(*args, process_group=None, **kwargs):
            return original_load(*args, process_group=process_group or group, **kwargs)

        dcp.save, dcp.load = save, load
        try:
            yield
        except RuntimeError as error:
            if "Connection closed by peer" in str(error) or "Connection reset" in str(error):
                raise CheckpointAborted(f"rank {self.rank}: a peer died during the checkpoint ({error})") from error
            raise
        finally:
            dcp.save, dcp.load = original_save, original_load


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

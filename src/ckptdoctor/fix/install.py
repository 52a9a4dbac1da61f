"""The minimal integration: one call after `accelerator.prepare(...)`, on every rank.

    self.model, ... = self.accelerator.prepare(...)
    import ckptdoctor
    ckptdoctor.install(self.accelerator)

From then on that Accelerator's own `save_state(dir)` and `load_state(dir)` are
`ScalableCheckpointing.save_state` / `load_state`: the fix's planner, writer, reader and load
planner on a checkpoint group with its own timeout; `dir` published atomically; loads only from
a complete checkpoint; a failure on any rank the same CheckpointAborted everywhere. The trainer's
other lines stay as they are, so local edits elsewhere in the file do not matter.

With `save_root=` (the directory holding the trainer's step directories; or CKPTDOCTOR_SAVE_ROOT),
a step a dead save left there is set aside at this call, before the trainer's own scan for its
newest step runs, so that a restart resumes from the newest complete step instead of stopping on
the dead one at every restart (publish.py). `ckptdoctor integrate` passes it when it can read the
root from the trainer's code. Without it, rank 0 warns once that a dead save will stop the
resume until its step is removed by hand.

Wherever Accelerate's own save_state works it does: one process with or without a process
group (then nothing to agree with: agreement.py), and Accelerate's automatic checkpoint naming
with `total_limit` applied only after the new checkpoint is published (automatic_naming.py); a
trainer that uses that naming publishes whole checkpoint directories and needs no `save_root`.

What it does not do (the full patch, `patches/mova-feat-npu.patch`, does): publish the whole step
directory at once (trainer_state.pt and LoRA weights are written beside the Accelerate state,
unpublished), save LoRA adapters without a full gather.

Where Accelerate saves through another engine than DCP on a process group (DeepSpeed, Megatron-LM,
XLA: `ENGINES`), the fix has nothing to route and is not tested there: `install` changes nothing,
returns None, and rank 0 logs one INFO line saying so; stock save_state runs.

Only this instance is changed (attributes on it; Accelerate's class is untouched). Calling
`install` again returns the same ScalableCheckpointing; calling it on an Accelerator that a
`ScalableCheckpointing(...)` of the full patch already serves, or making that one after `install`,
is refused with one line on every rank (one integration per Accelerator).
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)

ENGINES = {  # Accelerate's distributed types whose save_state goes through their own engine, not DCP
    "DEEPSPEED": "DeepSpeed saves through its own engine (model.save_checkpoint)",
    "MEGATRON_LM": "Megatron-LM saves through its own engine",
    "XLA": "XLA saves through torch_xla",
}
NOT_TAKEN = "_ckptdoctor_not_taken"  # set on an Accelerator install left stock (its INFO line said so once)


def engine_of(accelerator) -> str | None:
    """Why this Accelerator's save_state does not go through DCP (`ENGINES`), or None."""
    kind = getattr(accelerator, "distributed_type", None)  # absent on Accelerator-like stand-ins: not an engine
    return ENGINES.get(str(getattr(kind, "value", kind)))


def install(accelerator, **settings):
    """Every rank, after `accelerator.prepare(...)`: route this Accelerator's save_state and
    load_state through a new ScalableCheckpointing (`settings`: its keywords, e.g. timeout_s;
    unset ones come from CKPTDOCTOR_* variables). Returns it (None where `ENGINES` say no)."""
    from . import automatic_naming
    from .checkpointing import OWNER, ScalableCheckpointing

    engine = engine_of(accelerator)
    if engine is not None:
        if getattr(accelerator, "is_main_process", True) and not getattr(accelerator, NOT_TAKEN, False):
            log.info("ckptdoctor.install: %s, not DCP: this Accelerator's save_state and load_state stay stock "
                     "(the fix is not applied)", engine)
        setattr(accelerator, NOT_TAKEN, True)
        return None
    existing = getattr(accelerator, OWNER, None)
    if existing is not None and existing.integration == "install":
        return existing  # a second install; a ScalableCheckpointing of another kind is refused just below
    ckpt = ScalableCheckpointing(accelerator, integration="install", **settings)
    if ckpt.settings.save_root is None and ckpt.rank == 0 and not automatic_naming.enabled(accelerator):
        log.warning("ckptdoctor.install: no save_root given (keyword or CKPTDOCTOR_SAVE_ROOT): if a save dies, the "
                    "trainer's own scan may pick its incomplete step at the next start, and load_state will refuse it "
                    "until that step is removed; pass save_root=<the directory of your step directories>")

    accelerator.save_state = Routed(accelerator, "save_state", ckpt)
    accelerator.load_state = Routed(accelerator, "load_state", ckpt)
    return ckpt


class Routed:
    """An Accelerator's save_state, load_state (or, with async saves, end_training), routed
    through a ScalableCheckpointing.

    A copy of the Accelerator (pickle, deepcopy: Accelerate's own tests pickle one) does not take
    the checkpoint group along, which belongs to this process: in the copy the method is
    Accelerate's own again."""

    def __init__(self, accelerator, name: str, ckpt=None):
        self.accelerator, self.name, self.ckpt = accelerator, name, ckpt

    def __call__(self, directory: str | os.PathLike | None = None, *args, **kwargs):
        args = args if directory is None else (directory, *args)  # None is every method's default here
        if self.ckpt is None:
            return getattr(type(self.accelerator), self.name)(self.accelerator, *args, **kwargs)
        result = getattr(self.ckpt, self.name)(*args, **kwargs)
        return None if result is None else str(result)

    def __reduce__(self):
        return Routed, (self.accelerator, self.name)

"""Accelerate's DCP calls, routed through the fix for the duration of one save_state/load_state.

Accelerate calls `torch.distributed.checkpoint.save/load` itself (`save_fsdp_model`,
`save_fsdp_optimizer`, their load counterparts) with a `DefaultSavePlanner()` /
`DefaultLoadPlanner()`, a `FileSystemWriter/Reader(path)` and no process group. It takes no
planner, writer or group from its caller, so for one call `routed` replaces those two module
attributes with pass-throughs to torch's own functions that:

* put the checkpoint group in (`process_group`), so DCP's plan exchange and finish step run
  there, with its own timeout, and never on the training group;
* swap the planner for `ScalableSavePlanner` / `ScalableLoadPlanner` (a planner of another
  kind is refused: that save would not be the fix's), and the writer or reader for ours (same
  files; a plain FileSystemWriter/Reader carries no state of its own, so its class is changed
  in place and its settings kept);
* count every call and record each checkpoint's directory in the open publication, which
  publish.py checks before it publishes (a save that bypassed the fix fails there);
* for an async save (background.py), copy the state into the host copy and defer the save to
  the background thread, on the background's own group, instead of saving now.

Both attributes are restored on exit, also on error. Checked on the versions in
`compat.CHECKED`.
"""

from __future__ import annotations

import contextlib
import functools
import time
from pathlib import Path

from .agreement import CheckpointAborted
from .load_planner import ScalableLoadPlanner
from .planner import ScalableSavePlanner
from .storage import ScalableFileSystemReader, ScalableFileSystemWriter


@contextlib.contextmanager
def routed(group, verify_replicas: bool, record, opened=None, background=None):
    """Every rank, around Accelerate's save_state/load_state: its dcp.save/load go through the
    fix on `group`; `record` (summary.OperationRecord) counts them; `opened` (publish.Staging)
    receives each saved checkpoint's directory; with `background` (background.Background) each
    save is staged and deferred to it."""
    import torch.distributed.checkpoint as dcp

    original_save, original_load = dcp.save, dcp.load
    dcp.save = _routed_save(original_save, group, verify_replicas, record, opened, background)
    dcp.load = _routed_load(original_load, group)
    try:
        yield
    finally:
        dcp.save, dcp.load = original_save, original_load


def _routed_save(original, group, verify: bool, record, opened, background):
    from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemWriter

    @functools.wraps(original)
    def save(state_dict, *, checkpoint_id=None, storage_writer=None, planner=None, process_group=None, **kwargs):
        _refuse_a_foreign_planner(planner, DefaultSavePlanner, ScalableSavePlanner, "save")
        storage_writer = _ours(storage_writer, FileSystemWriter, ScalableFileSystemWriter, checkpoint_id)
        name = str(getattr(storage_writer, "path", checkpoint_id))
        if opened is not None:
            name = _relative(name, opened)
            opened.checkpoints.append(name)
        kwargs |= dict(checkpoint_id=checkpoint_id, storage_writer=storage_writer, process_group=process_group or group,
                       planner=ScalableSavePlanner(verify_replicas=verify))
        # a save rank 0 cannot derive (ranks holding different keys) takes the owned path by the
        # planner's own agreement, with one warning: nothing to retry here
        if background is not None:
            kwargs["process_group"] = background.group
            started = time.monotonic()
            background.defer(name, _counted(original, record, storage_writer), state_dict, **kwargs)
            record.add("host copy", time.monotonic() - started)
            return None
        return _counted(original, record, storage_writer)(state_dict, **kwargs)

    return save


def _counted(original, record, storage_writer):
    def save(state_dict, **kwargs):
        result = original(state_dict, **kwargs)
        record.checkpoints += 1
        record.bytes_written += getattr(storage_writer, "bytes_written", 0)  # rank 0's writer knows them all
        return result

    return save


def _routed_load(original, group):
    from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader

    @functools.wraps(original)
    def load(state_dict, *, checkpoint_id=None, storage_reader=None, planner=None, process_group=None, **kwargs):
        _refuse_a_foreign_planner(planner, DefaultLoadPlanner, (), "load")
        storage_reader = _ours(storage_reader, FileSystemReader, ScalableFileSystemReader, checkpoint_id)
        options = {} if planner is None else dict(flatten_state_dict=planner.flatten_state_dict,
                                                  flatten_sharded_tensors=planner.flatten_sharded_tensors,
                                                  allow_partial_load=planner.allow_partial_load)
        return original(state_dict, checkpoint_id=checkpoint_id, storage_reader=storage_reader,
                        planner=ScalableLoadPlanner(**options), process_group=process_group or group, **kwargs)

    return load


def _refuse_a_foreign_planner(planner, stock: type, ours, what: str) -> None:
    if planner is not None and type(planner) is not stock and not isinstance(planner, ours):
        raise CheckpointAborted(f"Accelerate passed a {type(planner).__name__}; ckptdoctor replaces only "
                                f"{stock.__name__}, so this {what} would not be the fix's")


def _ours(storage, plain: type, ours: type, checkpoint_id):
    """Our writer or reader for Accelerate's: a plain FileSystemWriter/Reader becomes ours in place
    (a subclass without state of its own: same settings); none given, ours at `checkpoint_id`."""
    if type(storage) is plain:
        storage.__class__ = ours
    elif storage is None and checkpoint_id is not None:
        storage = ours(checkpoint_id)
    return storage


def _relative(path, opened) -> str:
    return str(Path(path).resolve().relative_to(opened.staging().resolve()))

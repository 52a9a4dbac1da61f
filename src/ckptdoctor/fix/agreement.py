"""Every failure on any rank becomes the same CheckpointAborted on every rank.

A checkpoint has steps that one rank does alone (rank 0 creates the staging directory,
publishes, scans for the newest step, checks the data files before a load) and steps each rank
does on its own (Accelerate's save_state, what it sees of a checkpoint). If such a step raised
on one rank and that rank left, the others would wait in their next collective for the
checkpoint group's timeout (hours). So each such step ends in a collective that carries its
outcome: a rank that failed still takes part, with its reason, and every rank raises the same
CheckpointAborted naming the failed rank(s) and the first reason, within one collective.

One process without a process group (how a trainer is debugged, and Accelerate's own tests
run) has nobody to agree with: the step runs, and its failure is the CheckpointAborted.

A drop-in must not change what a caller catches: when the failure was one of Python's own
errors (a TypeError for a bad `map_location`, an OSError from a disk), the CheckpointAborted every
rank raises is also an instance of that class (`aborted`), so `except TypeError` still catches it,
as it caught stock's; `except CheckpointAborted` catches every kind.
"""

from __future__ import annotations

from ..errors import CkptDoctorError
from ..ranks import format_ranks
from . import dcp_failures


OK = "ok"  # a step that succeeded; any other outcome is one line saying why not


class CheckpointAborted(CkptDoctorError):
    """A save or load could not finish on every rank; nothing was published."""

    also = None  # the built-in error class this one is too (see `aborted`), or None

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""

    def __reduce__(self):
        return aborted, (str(self), self.also)


_ALSO: dict[type, type] = {}


def aborted(message: str, also: type | None = None) -> CheckpointAborted:
    """A CheckpointAborted that is also an instance of the built-in error class `also` (when that
    class can take a one-line message), else a plain one."""
    if also is None:
        return CheckpointAborted(message)
    try:
        if also not in _ALSO:
            _ALSO[also] = type("CheckpointAborted", (CheckpointAborted, also), {"also": also, "__module__": __name__})
        return _ALSO[also](message)
    except TypeError:  # e.g. UnicodeDecodeError takes five arguments
        return CheckpointAborted(message)


def builtin_kind(error: BaseException) -> type | None:
    """The error's class when it is one of Python's own (every rank can name it), else None."""
    kind = type(error)
    return kind if kind.__module__ == "builtins" and issubclass(kind, Exception) else None


def attempt(work) -> tuple[str, object, type | None]:
    """(OK, result, None) or ("failed", one line saying why, `builtin_kind` of the error). DCP's
    CheckpointException is a BaseException, so only interpreter exits pass through."""
    try:
        return OK, work(), None
    except (KeyboardInterrupt, SystemExit, GeneratorExit):
        raise
    except BaseException as error:  # noqa: BLE001 - every failure is reported to every rank
        return "failed", describe(error), builtin_kind(error)


def describe(error: BaseException) -> str:
    """One line. DCP's CheckpointException prints the ranks' tracebacks: its first failure's own
    line is what says why (e.g. "OSError: [Errno 28] No space left on device")."""
    failed = dcp_failures.per_rank(error)
    first = dcp_failures.first(error)
    if failed and isinstance(first, BaseException):
        return f"in DCP on rank(s) {format_ranks(sorted(failed))}: {describe(first)}"
    text = " ".join(str(error).split())[:400]
    return text if isinstance(error, CkptDoctorError) else f"{type(error).__name__}: {text}"


def alone(group) -> bool:
    """No process group at all (group None and none initialized): one process."""
    import torch.distributed as dist

    return group is None and not (dist.is_available() and dist.is_initialized())


def rank0_decides(group, what: str, work):
    """Rank 0 runs `work`; every rank returns its result, or raises the same CheckpointAborted."""
    import torch.distributed as dist

    if alone(group):
        status, value, kind = attempt(work)
    else:
        box = [attempt(work) if dist.get_rank(group) == 0 else None]
        dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
        status, value, kind = box[0]
    if status != OK:
        raise aborted(f"checkpoint aborted at '{what}': rank 0: {value}", kind)
    return value


def every_rank_agrees(group, what: str, work):
    """Every rank runs `work`; each returns its own result, or every rank raises the same
    CheckpointAborted naming the ranks that failed."""
    import torch.distributed as dist

    outcome = attempt(work)
    everyone = [outcome]
    if not alone(group):
        everyone = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, outcome, group=group)
    failed = [(rank, reason, kind) for rank, (status, reason, kind) in enumerate(everyone) if status != OK]
    if failed:
        raise aborted(f"checkpoint aborted at '{what}': rank(s) {format_ranks([f[0] for f in failed])}: "
                      f"{failed[0][1]}", failed[0][2])
    return outcome[1]

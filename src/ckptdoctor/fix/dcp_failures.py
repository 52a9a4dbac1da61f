"""What a failed DCP call says, read one way everywhere.

DCP gathers every rank's exception of a collective step and raises a `CheckpointException`
(a BaseException) on every rank, whose `failures` maps each failed rank to its exception, or to
(exception, traceback) on some versions. The fix names the failed ranks and the lowest one's
own line (agreement.describe) and turns a failed load into one CheckpointAborted.
"""

from __future__ import annotations


def per_rank(error: BaseException) -> dict[int, BaseException]:
    """Failed rank -> its exception; empty for an error that is not DCP's per-rank report."""
    failures = getattr(error, "failures", None)
    if not isinstance(failures, dict):
        return {}
    return {rank: (f[0] if isinstance(f, tuple) else f) for rank, f in failures.items()}


def first(error: BaseException) -> BaseException:
    """The lowest failed rank's exception, or the error itself."""
    ranks = per_rank(error)
    return ranks[min(ranks)] if ranks else error

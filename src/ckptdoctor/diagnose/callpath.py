"""What the frames of a checkpoint failure mean: which save, which phase, which wait.

Shared by the reproduction (to check it failed for the stated reason) and the log
diagnoser (to explain a failure from a traceback). Function names are torch's and
Accelerate's; they are the same in the user's stack (torch 2.8.0, Accelerate 1.13.0) and
the newest ones (torch 2.14.1 and 2.15.0, Accelerate 1.15.0 and 1.16.0), only line numbers move.
"""

from __future__ import annotations

import dataclasses
import re


# The report's frames, outermost first (function names only), from save_state down.
REPORTED_SAVE_FRAMES = ("save_state", "save_fsdp_optimizer", "save", "_save_state_dict", "reduce_scatter",
                        "scatter_object", "scatter_object_list", "broadcast")

GLOO_TIMEOUT = re.compile(r"\[[^\]]*gloo[^\]]*\] Timed out waiting (\d+)ms for (recv|send) operation to complete")

_TARGETS = {"save_fsdp_model": ("save", "model"), "save_fsdp_optimizer": ("save", "optimizer"),
            "load_fsdp_model": ("load", "model"), "load_fsdp_optimizer": ("load", "optimizer")}

# (DistWrapper method, object collective inside it) -> phase name
_PHASES = (
    (("reduce_scatter", "scatter_object"), "plan-scatter"),
    (("reduce_scatter", "gather_object"), "plan-gather"),
    (("all_reduce", "gather_object"), "finish-gather"),
    (("all_reduce", "broadcast_object"), "finish-scatter"),
    (("all_gather", "all_gather_object"), "plan-all-gather"),
    (("broadcast", "broadcast_object"), "broadcast"),
)


_COLLECTIVES = ("broadcast", "gather", "scatter", "all_gather", "all_reduce", "reduce_scatter_tensor",
                "all_gather_into_tensor", "barrier", "recv", "send")


@dataclasses.dataclass(frozen=True)
class FailurePoint:
    operation: str | None   # "save" | "load" | None
    target: str | None      # "model" | "optimizer" | None
    accelerate_call: str | None
    phase: str | None       # "plan-scatter", "plan-gather", "finish-gather", ...
    waiting_call: str | None  # the innermost torch.distributed collective, e.g. "broadcast"


def _is_subsequence(needle, haystack) -> bool:
    it = iter(haystack)
    return all(any(x == y for y in it) for x in needle)


def locate(frames: list[str]) -> FailurePoint:
    """Classify a list of function names (outermost first)."""
    call = next((f for f in frames if f in _TARGETS), None)
    operation, target = _TARGETS.get(call, (None, None))
    if operation is None and "_save_state_dict" in frames:
        operation = "save"
    if operation is None and "_load_state_dict" in frames:
        operation = "load"
    phase = next((name for pair, name in _PHASES if _is_subsequence(pair, frames)), None)
    # The innermost torch.distributed collective is the wait that timed out.
    waiting = next((f for f in reversed(frames) if f in _COLLECTIVES), None)
    return FailurePoint(operation, target, call, phase, waiting)


def matches_report(frames: list[str]) -> bool:
    """True when the reported chain save_state -> ... -> broadcast appears in order."""
    return _is_subsequence(REPORTED_SAVE_FRAMES, frames)


def gloo_timeout_ms(text: str) -> int | None:
    match = GLOO_TIMEOUT.search(text)
    return int(match.group(1)) if match else None

"""The two pinned software stacks and the version checks that guard version-specific code."""

from __future__ import annotations

import dataclasses
from ..errors import UnsupportedVersion
from ..fix.compat import installed_versions


@dataclasses.dataclass(frozen=True)
class Stack:
    name: str
    torch: str
    accelerate: str


USER = Stack("user", torch="2.8.0", accelerate="1.13.0")      # pinned by the report's line numbers
NEWEST = Stack("newest", torch="2.15.0", accelerate="1.16.0")  # CI's second stack
STACKS = {s.name: s for s in (USER, NEWEST)}


def current_stack() -> Stack:
    """The pinned stack this interpreter runs; a clear error for any other combination."""
    torch_v, acc_v = installed_versions()
    for stack in STACKS.values():
        if (stack.torch, stack.accelerate) == (torch_v, acc_v):
            return stack
    supported = ", ".join(f"torch {s.torch} + accelerate {s.accelerate}" for s in STACKS.values())
    raise UnsupportedVersion(
        f"unsupported versions torch {torch_v} + accelerate {acc_v}; supported: {supported} "
        f"(run scripts/setup.sh user|newest)")


def stack_by_name(name: str) -> Stack:
    try:
        return STACKS[name]
    except KeyError:
        raise UnsupportedVersion(f"unknown stack {name!r}; expected one of: {', '.join(STACKS)}") from None

"""The process group DCP is about to exchange a save's plans on, as the planner sees it.

DCP gives a planner no process group: `dcp.save(process_group=...)` builds a `_DistWrapper`
(torch.distributed.checkpoint.utils) and calls the planner from inside its `reduce_scatter`,
which then gathers the local plans on that group, or, for `no_dist=True` (and torch 2.9+'s
`use_collectives=False`), on nothing. ScalableSavePlanner's agreement (planner.py) is one
collective before that gather; on any other group than DCP's it could wait for ranks that are
not saving (a subgroup's save, rank 0 saving alone with `no_dist`). So it runs on exactly the
group DCP is about to use, read here from the calling `_DistWrapper.reduce_scatter` frame, and
not at all when there is none (the plan step is not collective, or the planner is driven
outside `dcp.save`, as `check`'s simulations do).

Reading a caller's frame is a last resort, kept to this module: `_DistWrapper`'s `group` and
`use_dist` and the name `reduce_scatter` are the same in every torch the gate accepts
(compat.CHECKED, 2.8 to 2.15); tests/fix/test_plan_group.py checks them on each stack.
"""

from __future__ import annotations

import dataclasses
import sys

MAX_DEPTH = 12  # planner -> local_step -> (a logging wrapper or two) -> reduce_scatter


@dataclasses.dataclass(frozen=True)
class PlanGroup:
    group: object  # the ProcessGroup, or None for the default group


def plan_group() -> PlanGroup | None:
    """The group of the DCP plan exchange this call runs inside, or None when DCP exchanges no
    plans (no_dist, use_collectives=False) or the caller is not DCP's plan step."""
    from torch.distributed.checkpoint.utils import _DistWrapper

    frame = sys._getframe(1)
    for _ in range(MAX_DEPTH):
        if frame is None:
            return None
        if frame.f_code.co_name == "reduce_scatter":
            wrapper = frame.f_locals.get("self")
            if isinstance(wrapper, _DistWrapper):
                return PlanGroup(wrapper.group) if wrapper.use_dist else None
        frame = frame.f_back
    return None

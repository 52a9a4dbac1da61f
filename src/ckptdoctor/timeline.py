"""Per-rank timelines of DCP saves, read from torch's own DCP logger.

torch wraps the steps of `dcp.save` (`local_step`, `global_step`, `write_data`,
`finish_checkpoint`) in `_dcp_method_logger`, which logs a start and an end event with a
nanosecond timestamp to the "dcp_logger" logger at DEBUG level. Attaching a handler there
observes the real save without touching its code. The gather and scatter of the plan
exchange have no events of their own; they are the gaps between those steps.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time

STEPS = ("local_step", "global_step", "write_data", "finish_checkpoint")
PHASE_NAMES = {
    "local_step": "local plan",
    "global_step": "global plan (rank 0)",
    "write_data": "write",
    "finish_checkpoint": "finish (rank 0 writes metadata)",
}


@dataclasses.dataclass
class StepEvent:
    """One start/end/exception event of a DCP step on one rank."""

    rank: int
    save: str  # the checkpoint directory's name, e.g. "optimizer_0"
    step: str
    event: str
    time_s: float
    error: str | None = None


class DcpEventRecorder(logging.Handler):
    """Collects DCP step events of this process; install() hooks it onto torch's logger."""

    def __init__(self, rank: int):
        super().__init__(level=logging.DEBUG)
        self.rank = rank
        self.events: list[StepEvent] = []

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.msg
        if not isinstance(msg, dict) or msg.get("func_name") not in STEPS + ("save", "_save_state_dict"):
            return
        checkpoint_id = msg.get("checkpoint_id") or ""
        self.events.append(StepEvent(
            rank=self.rank, save=os.path.basename(os.path.normpath(checkpoint_id)),
            step=msg["func_name"], event=msg.get("event", "?"),
            time_s=msg.get("time", time.time_ns()) / 1e9, error=msg.get("error")))

    def install(self) -> "DcpEventRecorder":
        _dcp_logger().addHandler(self)
        return self

    def uninstall(self) -> None:
        _dcp_logger().removeHandler(self)


def _dcp_logger() -> logging.Logger:
    """The logger `_dcp_method_logger` writes to (torch 2.8 and 2.14 name it
    "c10d-NullHandler-dcp_logger", set to DEBUG, not propagating)."""
    from torch.distributed.checkpoint import logger as dcp_logging

    return dcp_logging._dcp_logger


@dataclasses.dataclass
class Span:
    rank: int
    phase: str
    start_s: float
    end_s: float | None  # None: still running when the rank stopped

    @property
    def duration_s(self) -> float | None:
        return None if self.end_s is None else self.end_s - self.start_s


def step_spans(events: list[StepEvent], save: str) -> dict[tuple[int, str], Span]:
    """(rank, step) -> span of that step in the named save."""
    spans: dict[tuple[int, str], Span] = {}
    for ev in events:
        if ev.save != save or ev.step not in STEPS:
            continue
        key = (ev.rank, ev.step)
        if ev.event == "start":
            spans[key] = Span(ev.rank, ev.step, ev.time_s, None)
        elif key in spans:
            spans[key].end_s = ev.time_s
    return spans


def save_timeline(events: list[StepEvent], save: str, world_size: int, coordinator: int = 0) -> list[Span]:
    """Every rank's phases of one save, gaps included, ordered by rank then time.

    Gaps: on the coordinator, "gather" runs from its local plan's end to its global plan's
    start and "scatter" from the global plan's end to its write; on the other ranks the
    whole exchange is one wait, "waiting for plan (gather + scatter)".
    """
    steps = step_spans(events, save)
    timeline: list[Span] = []
    for rank in range(world_size):
        own = {step: steps[(rank, step)] for step in STEPS if (rank, step) in steps}
        timeline += _with_gaps(rank, own, rank == coordinator)
    return timeline


def _with_gaps(rank: int, own: dict[str, Span], is_coordinator: bool) -> list[Span]:
    if is_coordinator:
        gaps = (("local_step", "global_step", "gather"), ("global_step", "write_data", "scatter"),
                ("write_data", "finish_checkpoint", "gather write results"))
    else:
        gaps = (("local_step", "write_data", "waiting for plan (gather + scatter)"),)
    spans = [Span(rank, PHASE_NAMES[s.phase], s.start_s, s.end_s) for s in own.values()]
    for before, after, name in gaps:
        if before in own and own[before].end_s is not None:
            end = own[after].start_s if after in own else None
            spans.append(Span(rank, name, own[before].end_s, end))
    return sorted(spans, key=lambda s: s.start_s)


@dataclasses.dataclass
class PlanExchangeCosts:
    """What one save's plan exchange asks of the deadline, in seconds."""

    save: str
    coordinator_plan_s: float  # last local plan done -> rank 0 starts writing: the peers' scatter wait
    global_plan_s: float       # rank 0's global_step alone
    local_plan_skew_s: float   # spread of local-plan end times: the wait in the gather's size exchange
    finish_wait_s: float       # spread of write end times + rank 0's metadata write

    @property
    def other_waits_s(self) -> float:
        return max(self.local_plan_skew_s, self.finish_wait_s)


def plan_exchange_costs(events: list[StepEvent], save: str, world_size: int, coordinator: int = 0) -> PlanExchangeCosts:
    """Measured from a completed save; raises ValueError when a step is missing."""
    steps = step_spans(events, save)

    def span(rank, step) -> Span:
        s = steps.get((rank, step))
        if s is None or s.end_s is None:
            raise ValueError(f"save {save!r}: rank {rank} has no complete {step}")
        return s

    local_ends = [span(r, "local_step").end_s for r in range(world_size)]
    write_ends = [span(r, "write_data").end_s for r in range(world_size)]
    finish = span(coordinator, "finish_checkpoint")
    return PlanExchangeCosts(
        save=save,
        coordinator_plan_s=span(coordinator, "write_data").start_s - max(local_ends),
        global_plan_s=span(coordinator, "global_step").duration_s,
        local_plan_skew_s=max(local_ends) - min(local_ends),
        finish_wait_s=max(write_ends) - min(write_ends) + finish.duration_s,
    )


def phase_at(timeline: list[Span], rank: int, when_s: float) -> Span | None:
    """The phase `rank` was in at time `when_s` (None when it had no phase then)."""
    current = None
    for span in timeline:
        if span.rank == rank and span.start_s <= when_s and (span.end_s is None or span.end_s >= when_s):
            current = span
    return current

"""Per-rank timelines of DCP saves, from what probes.py records (the lab's; pure analysis, no torch).

DCP's own events mark the steps of a save (`local_step`, `global_step`, `write_data`,
`finish_checkpoint`); the plan exchange between them has no events of its own, so its
gather and scatter are the gaps, and the timed object collectives say how long each rank
actually waited in them.
"""

from __future__ import annotations

import collections
import dataclasses

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


@dataclasses.dataclass
class CollectiveCall:
    """One timed call of a torch.distributed object collective (or barrier) on one rank."""

    rank: int
    name: str  # e.g. "scatter_object_list"
    start_s: float
    end_s: float
    ok: bool
    default_group: bool = True  # on the default group (which carries the scaled deadline), not another


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


def save_timeline(events: list[StepEvent], save: str, world_size: int, coordinator: int = 0,
                  calls: list[CollectiveCall] | None = None) -> list[Span]:
    """Every rank's phases of one save, gaps included, ordered by rank then time.

    Gaps: on the coordinator, the gather runs from its local plan's end to its global
    plan's start, split at the moment the last rank finished its local plan (before it,
    rank 0 waits for peers; after it, it receives and unpickles their plans), and the
    scatter (pickling and sending the plans) from the global plan's end to its write. On
    the other ranks the whole exchange is one wait, "waiting for plan (gather + scatter)",
    split into its collectives when their timings (`calls`) are given.
    """
    steps = step_spans(events, save)
    local_ends = [s.end_s for (rank, step), s in steps.items() if step == "local_step" and s.end_s is not None]
    last_local_end = max(local_ends) if len(local_ends) == world_size else None
    timeline: list[Span] = []
    for rank in range(world_size):
        own = {step: steps[(rank, step)] for step in STEPS if (rank, step) in steps}
        spans = _with_gaps(rank, own, rank == coordinator, last_local_end)
        if calls is not None and rank != coordinator:
            spans = _peer_collectives(rank, spans, calls_in_save(calls, events, save))
        elif calls is not None:
            spans = _coordinator_collectives(rank, spans, calls_in_save(calls, events, save))
        timeline += spans
    return timeline


PEER_WAITS = {("gather_object", 0): "plan gather (gather_object)",
              ("scatter_object_list", 0): "plan scatter: waiting for rank 0 (scatter_object_list)",
              ("gather_object", 1): "finish: gather write results (gather_object)",
              ("broadcast_object_list", 0): "finish: waiting for rank 0 (broadcast_object_list)"}


def _peer_collectives(rank: int, spans: list[Span], calls: list[CollectiveCall]) -> list[Span]:
    """Replace a peer's one "waiting for plan" gap by the collectives it was in."""
    mine = sorted((c for c in calls if c.rank == rank and not c.name.startswith("c10d.")), key=lambda c: c.start_s)
    if not mine:
        return spans
    kept = [s for s in spans if not s.phase.startswith("waiting for plan")]
    seen: collections.Counter = collections.Counter()
    for call in mine:
        phase = PEER_WAITS.get((call.name, seen[call.name]), call.name)
        seen[call.name] += 1
        kept.append(Span(rank, phase if call.ok else f"{phase} FAILED", call.start_s, call.end_s))
    return sorted(kept, key=lambda s: s.start_s)


def _coordinator_collectives(rank: int, spans: list[Span], calls: list[CollectiveCall]) -> list[Span]:
    """Split rank 0's gather into waiting / receiving / unpickling and its scatter into
    pickling / sending, from the gloo operations inside its object collectives."""
    mine = sorted((c for c in calls if c.rank == rank), key=lambda c: c.start_s)
    gather = next((c for c in mine if c.name == "gather_object"), None)
    scatter = next((c for c in mine if c.name == "scatter_object_list"), None)
    if gather is None or scatter is None:
        return spans
    inner = lambda outer, name: next((c for c in mine if c.name == name and outer.start_s <= c.start_s <= outer.end_s), None)  # noqa: E731
    wait, receive, send = inner(gather, "c10d.all_gather"), inner(gather, "c10d.gather"), inner(scatter, "c10d.broadcast")
    if wait is None or receive is None or send is None:
        return spans
    kept = [s for s in spans if not (s.phase.startswith("gather") and s.phase != "gather write results")
            and s.phase != "scatter"]
    kept += [Span(rank, "gather: waiting for local plans (all_gather)", wait.start_s, wait.end_s),
             Span(rank, "gather: receiving plans (gather)", receive.start_s, receive.end_s),
             Span(rank, "gather: unpickling plans", receive.end_s, gather.end_s if gather.ok else None),
             Span(rank, "scatter: pickling plans", scatter.start_s, send.start_s),
             Span(rank, "scatter: sending plans", send.start_s, scatter.end_s if scatter.ok else None)]
    return sorted(kept, key=lambda s: s.start_s)


def _with_gaps(rank: int, own: dict[str, Span], is_coordinator: bool, last_local_end: float | None) -> list[Span]:
    if is_coordinator:
        gaps = (("local_step", "global_step", "gather"), ("global_step", "write_data", "scatter"),
                ("write_data", "finish_checkpoint", "gather write results"))
    else:
        gaps = (("local_step", "write_data", "waiting for plan (gather + scatter)"),)
    spans = [Span(rank, PHASE_NAMES[s.phase], s.start_s, s.end_s) for s in own.values()]
    for before, after, name in gaps:
        if before in own and own[before].end_s is not None:
            end = own[after].start_s if after in own else None
            spans += _split_gather(rank, name, own[before].end_s, end, last_local_end)
    return sorted(spans, key=lambda s: s.start_s)


def _split_gather(rank, name, start, end, last_local_end) -> list[Span]:
    if name != "gather" or last_local_end is None or last_local_end <= start:
        return [Span(rank, name, start, end)]
    if end is not None and last_local_end >= end:
        return [Span(rank, "gather: waiting for local plans", start, end)]
    return [Span(rank, "gather: waiting for local plans", start, last_local_end),
            Span(rank, "gather: receive + unpickle plans", last_local_end, end)]


def save_intervals(events: list[StepEvent]) -> dict[tuple[int, str], tuple[float, float | None]]:
    """(rank, save) -> (start, end) of the whole `dcp.save` call on that rank."""
    out: dict[tuple[int, str], tuple[float, float | None]] = {}
    for ev in events:
        if ev.step != "save":
            continue
        key = (ev.rank, ev.save)
        if ev.event == "start":
            out[key] = (ev.time_s, None)
        elif key in out:
            out[key] = (out[key][0], ev.time_s)
    return out


def calls_in_save(calls: list[CollectiveCall], events: list[StepEvent], save: str) -> list[CollectiveCall]:
    """The timed collectives each rank made inside its `dcp.save` of `save`."""
    intervals = save_intervals(events)
    inside = []
    for call in calls:
        span = intervals.get((call.rank, save))
        if span and span[0] <= call.start_s and (span[1] is None or call.start_s <= span[1]):
            inside.append(call)
    return inside


@dataclasses.dataclass
class SaveWaits:
    """How long ranks waited in one save's gloo operations, in seconds (measured per call).

    Each gloo operation has its own deadline, so these are the numbers a deadline is
    compared with: the peers' wait in the plan scatter's `broadcast` (for rank 0 to finish
    planning), and the longest single wait before and after it.
    """

    save: str
    coordinator_plan_s: float   # DCP steps: last local plan done -> rank 0 starts writing
    plan_scatter_wait_s: tuple[float, float]  # (shortest, longest) peer wait in the plan scatter's broadcast
    before_scatter_wait_s: float
    after_scatter_wait_s: float


def save_waits(events: list[StepEvent], calls: list[CollectiveCall], save: str, world_size: int,
               coordinator: int = 0) -> SaveWaits:
    """Measured from a completed save; raises ValueError when a rank's steps are missing."""
    steps = step_spans(events, save)

    def span(rank, step) -> Span:
        s = steps.get((rank, step))
        if s is None or s.end_s is None:
            raise ValueError(f"save {save!r}: rank {rank} has no complete {step}")
        return s

    last_local = max(span(r, "local_step").end_s for r in range(world_size))
    inside = calls_in_save(calls, events, save)
    ops = [c for c in inside if c.name.startswith("c10d.")]
    plan_broadcasts = [_first_op_within(ops, c, "c10d.broadcast") for c in inside
                       if c.name == "scatter_object_list" and c.rank != coordinator]
    if len(plan_broadcasts) != world_size - 1 or None in plan_broadcasts:
        raise ValueError(f"save {save!r}: expected one plan-scatter broadcast per peer")
    first = min(c.start_s for c in plan_broadcasts)
    others = [c for c in ops if c not in plan_broadcasts]
    waits = [c.end_s - c.start_s for c in plan_broadcasts]
    return SaveWaits(
        save=save,
        coordinator_plan_s=span(coordinator, "write_data").start_s - last_local,
        plan_scatter_wait_s=(min(waits), max(waits)),
        before_scatter_wait_s=_longest([c for c in others if c.start_s < first]),
        after_scatter_wait_s=_longest([c for c in others if c.start_s >= first]),
    )


def _first_op_within(ops: list[CollectiveCall], outer: CollectiveCall, name: str) -> CollectiveCall | None:
    inner = [c for c in ops if c.rank == outer.rank and c.name == name and outer.start_s <= c.start_s <= outer.end_s]
    return min(inner, key=lambda c: c.start_s, default=None)


def _longest(calls: list[CollectiveCall]) -> float:
    return max((c.end_s - c.start_s for c in calls), default=0.0)


def longest_wait(calls: list[CollectiveCall], name: str) -> float:
    return max((c.end_s - c.start_s for c in calls if c.name == name), default=0.0)


def phase_at(timeline: list[Span], rank: int, when_s: float) -> Span | None:
    """The phase `rank` was in at time `when_s` (None when it had no phase then)."""
    current = None
    for span in timeline:
        if span.rank == rank and span.start_s <= when_s and (span.end_s is None or span.end_s >= when_s):
            current = span
    return current

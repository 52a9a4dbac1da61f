import pytest
import torch
import torch.distributed.checkpoint as dcp

from ckptdoctor.repro.timeline import CollectiveCall, StepEvent, phase_at, save_timeline, save_waits
from ckptdoctor.repro.probes import SaveProbe

SAVE = "optimizer_0"


def _events(save=SAVE):
    """Two ranks: rank 1 finishes its local plan last (t=2), rank 0 plans globally 3..7."""
    spec = [(0, "save", -0.5, 10.0), (1, "save", -0.5, 10.0),
            (0, "local_step", 0.0, 1.0), (1, "local_step", 0.5, 2.0), (0, "global_step", 3.0, 7.0),
            (0, "write_data", 8.0, 9.0), (1, "write_data", 8.1, 9.5), (0, "finish_checkpoint", 9.6, 9.8)]
    out = []
    for rank, step, start, end in spec:
        out += [StepEvent(rank, save, step, "start", start), StepEvent(rank, save, step, "end", end)]
    return out


def _calls():
    return [CollectiveCall(1, "gather_object", 2.0, 2.1, True), CollectiveCall(1, "scatter_object_list", 2.1, 8.05, True),
            CollectiveCall(0, "gather_object", 1.0, 3.0, True), CollectiveCall(0, "scatter_object_list", 7.0, 8.0, True),
            CollectiveCall(1, "gather_object", 9.5, 9.55, True), CollectiveCall(1, "broadcast_object_list", 9.55, 9.9, True),
            CollectiveCall(1, "barrier", 20.0, 21.0, True),  # outside the save
            # the gloo operations inside them: each is one wait with its own deadline
            CollectiveCall(0, "c10d.all_gather", 1.0, 2.0, True), CollectiveCall(0, "c10d.gather", 2.0, 2.2, True),
            CollectiveCall(1, "c10d.all_gather", 2.0, 2.02, True), CollectiveCall(1, "c10d.gather", 2.02, 2.04, True),
            CollectiveCall(1, "c10d.broadcast", 2.1, 7.6, True), CollectiveCall(1, "c10d.scatter", 7.6, 7.65, True),
            CollectiveCall(0, "c10d.broadcast", 7.5, 7.6, True),
            CollectiveCall(1, "c10d.broadcast", 9.55, 9.85, True)]


def test_timeline_fills_the_gather_and_scatter_gaps():
    spans = save_timeline(_events(), SAVE, world_size=2)
    rank0 = [(s.phase, s.start_s, s.end_s) for s in spans if s.rank == 0]
    assert rank0 == [("local plan", 0.0, 1.0), ("gather: waiting for local plans", 1.0, 2.0),
                     ("gather: receive + unpickle plans", 2.0, 3.0), ("global plan (rank 0)", 3.0, 7.0),
                     ("scatter", 7.0, 8.0), ("write", 8.0, 9.0), ("gather write results", 9.0, 9.6),
                     ("finish (rank 0 writes metadata)", 9.6, 9.8)]
    rank1 = [(s.phase, s.start_s, s.end_s) for s in spans if s.rank == 1]
    assert rank1[1] == ("waiting for plan (gather + scatter)", 2.0, 8.1)


def test_with_timed_calls_a_peers_wait_is_split_into_its_collectives():
    spans = save_timeline(_events(), SAVE, world_size=2, calls=_calls())
    rank1 = [(s.phase, s.start_s, s.end_s) for s in spans if s.rank == 1]
    assert rank1 == [("local plan", 0.5, 2.0), ("plan gather (gather_object)", 2.0, 2.1),
                     ("plan scatter: waiting for rank 0 (scatter_object_list)", 2.1, 8.05), ("write", 8.1, 9.5),
                     ("finish: gather write results (gather_object)", 9.5, 9.55),
                     ("finish: waiting for rank 0 (broadcast_object_list)", 9.55, 9.9)]


def test_save_waits_are_what_the_deadline_must_cover():
    waits = save_waits(_events(), _calls(), SAVE, world_size=2)
    assert waits.coordinator_plan_s == pytest.approx(6.0)  # last local plan (2.0) -> rank 0 writes (8.0)
    assert waits.plan_scatter_wait_s == pytest.approx((5.5, 5.5))  # the broadcast, not the unpickling after it
    assert waits.before_scatter_wait_s == pytest.approx(1.0)  # rank 0's all_gather waited for rank 1's plan
    assert waits.after_scatter_wait_s == pytest.approx(0.3)   # the finish broadcast; the barrier is outside


def test_a_step_that_never_ended_is_still_running_and_waits_refuse_it():
    events = [e for e in _events() if not (e.rank == 0 and e.step == "write_data" and e.event == "end")]
    events = [e for e in events if not (e.rank == 0 and e.step == "write_data")]
    spans = save_timeline(events, SAVE, world_size=2)
    assert phase_at(spans, 0, when_s=7.5).phase == "scatter" and phase_at(spans, 0, 7.5).end_s is None
    with pytest.raises(ValueError, match="rank 0 has no complete write_data"):
        save_waits(events, _calls(), SAVE, world_size=2)


def test_probe_sees_the_steps_of_a_real_dcp_save_and_restores_torch(tmp_path):
    import torch.distributed as dist

    original = dist.scatter_object_list
    probe = SaveProbe(rank=0).install()
    assert dist.scatter_object_list is not original
    try:
        dcp.save({"w": torch.arange(6.0)}, checkpoint_id=str(tmp_path / SAVE))
    finally:
        probe.uninstall()
    assert dist.scatter_object_list is original
    seen = {(e.save, e.step, e.event) for e in probe.events}
    for step in ("save", "local_step", "global_step", "write_data", "finish_checkpoint"):
        assert (SAVE, step, "start") in seen and (SAVE, step, "end") in seen
    assert [s.phase for s in save_timeline(probe.events, SAVE, world_size=1)][:2] == ["local plan", "gather"]


def test_with_timed_calls_rank0s_gather_and_scatter_are_split_into_wait_receive_unpickle_pickle_send():
    spans = save_timeline(_events(), SAVE, world_size=2, calls=_calls())
    rank0 = [(s.phase, s.start_s, s.end_s) for s in spans if s.rank == 0][1:6]
    assert rank0 == [("gather: waiting for local plans (all_gather)", 1.0, 2.0), ("gather: receiving plans (gather)", 2.0, 2.2),
                     ("gather: unpickling plans", 2.2, 3.0), ("global plan (rank 0)", 3.0, 7.0),
                     ("scatter: pickling plans", 7.0, 7.5)]

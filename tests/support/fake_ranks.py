"""Torch's fake process group for tests, and random state dicts planned as every rank of a
world in it: shared by the planner, storage and simulator tests."""

import torch
from hypothesis import strategies as st


def fake_world(rank: int, world: int, mesh_shape: tuple[int, ...]):
    """Rank `rank` of `world` in torch's fake process group, on a 1-D (fsdp) or 2-D (hsdp) mesh."""
    from ckptdoctor.check.layout import Layout
    from ckptdoctor.check.fake_world import init_fake_world

    layout = Layout.parse("fsdp" if len(mesh_shape) == 1 else f"hsdp:{mesh_shape[1]}")
    assert layout.mesh_shape(world) == mesh_shape
    return init_fake_world(rank, world, layout)


def leave_fake_world() -> None:
    """Later tests in this process must not find a process group (dcp.save would use it)."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


@st.composite
def random_state_dicts(draw):
    """(world, mesh shape, DTensor specs, plain tensor shapes, bytes values)."""
    world = draw(st.sampled_from([2, 3, 4, 6, 8]))
    mesh_shape = draw(st.sampled_from([(world,)] + ([(2, world // 2)] if world % 2 == 0 and world > 2 else [])))
    dtensors = []
    for _ in range(draw(st.integers(1, 4))):
        shape = tuple(draw(st.lists(st.integers(1, 10), min_size=1, max_size=3)))
        placements = tuple(draw(st.sampled_from([None, *range(len(shape))])) for _ in mesh_shape)  # None: Replicate
        dtensors.append((shape, placements))
    plain = draw(st.lists(st.lists(st.integers(1, 5), max_size=2).map(tuple), max_size=2))
    values = draw(st.lists(st.integers(0, 99), max_size=2))
    return world, mesh_shape, dtensors, plain, values


def build_random(mesh, dtensors, plain, values) -> dict:
    from torch.distributed.tensor import Replicate, Shard

    from ckptdoctor.check.state_dicts import _meta_dtensor

    state = {f"d{i}": _meta_dtensor(shape, mesh, [Replicate() if p is None else Shard(p) for p in placements])
             for i, (shape, placements) in enumerate(dtensors)}
    state |= {f"p{i}": torch.empty(shape, device="meta") for i, shape in enumerate(plain)}
    return state | {f"b{i}": value for i, value in enumerate(values)}


def planned_as_every_rank(case, make_planner):
    """(rank, planner, local plan) for every rank of `case`'s world: the planner set up on that
    rank's state dict in torch's fake process group, after `create_local_plan`."""
    world, mesh_shape, dtensors, plain, values = case
    try:
        for rank in range(world):
            planner = make_planner()
            planner.set_up_planner(build_random(fake_world(rank, world, mesh_shape), dtensors, plain, values),
                                   None, rank == 0)
            yield rank, planner, planner.create_local_plan()
    finally:
        leave_fake_world()


def saved_as_every_rank(case, make_planner):
    """Every rank's planner taken through DCP's protocol in torch's fake process group: each
    rank's local plan, rank 0's global plan over all of them, each rank's final plan.
    Returns (the planners, by rank; the global metadata)."""
    planners, local_plans = [], []
    for _, planner, plan in planned_as_every_rank(case, make_planner):
        planners.append(planner)
        local_plans.append(plan)
    global_plans, metadata = planners[0].create_global_plan(local_plans)
    for planner, plan in zip(planners, global_plans):
        planner.finish_plan(plan)
    return planners, metadata

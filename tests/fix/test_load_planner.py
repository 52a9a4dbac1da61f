"""ScalableLoadPlanner in one process (no process group: DCP loads without one): what it does
where stock refuses or loads a part, item for item against DefaultLoadPlanner."""

import pytest
import torch
import torch.distributed.checkpoint as dcp

from ckptdoctor.fix.load_planner import ScalableLoadPlanner


@pytest.fixture
def saved(tmp_path):
    dcp.save({"w": torch.arange(4.0), "v": torch.full((2, 3), 5.0)}, checkpoint_id=tmp_path / "ckpt")
    return tmp_path / "ckpt"


def outcome(path, state, planner):
    """("ok", the state after the load) or ("error", its message), for one planner."""
    try:
        dcp.load(state, checkpoint_id=path, planner=planner)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as error:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        failures = getattr(error, "failures", None)
        first = next(iter(failures.values())) if failures else error
        return "error", str(first[0] if isinstance(first, tuple) else first)
    return "ok", {k: v.clone() for k, v in state.items()}


@pytest.mark.parametrize("state, partial", [
    ({"w": torch.zeros(5)}, False),                               # a size that does not match
    ({"w": torch.zeros(4), "extra": torch.zeros(2)}, False),      # a key the checkpoint lacks: refused ...
    ({"w": torch.zeros(4), "extra": torch.zeros(2)}, True),       # ... unless a partial load is asked for
    ({"w": torch.zeros(4)}, False),                               # fewer keys than saved: stock's own plan
])
def test_ours_refuses_or_loads_exactly_as_stock_does(saved, state, partial):
    stock = outcome(saved, {k: v.clone() for k, v in state.items()}, dcp.DefaultLoadPlanner(allow_partial_load=partial))
    ours = outcome(saved, {k: v.clone() for k, v in state.items()}, ScalableLoadPlanner(allow_partial_load=partial))
    assert ours[0] == stock[0]
    if ours[0] == "error":
        assert ours[1] == stock[1] and ("Size mismatch" in ours[1] or "Missing key" in ours[1]), ours[1]
    else:
        assert ours[1].keys() == stock[1].keys() and all(torch.equal(ours[1][k], stock[1][k]) for k in ours[1])
        assert torch.equal(ours[1]["w"], torch.arange(4.0))  # the saved values, not the zeros

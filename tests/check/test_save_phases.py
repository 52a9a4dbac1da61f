"""A save's phases in one process (check/save_phases.py): every rank's plan derived by symmetry
from rank 0's, checked against construction, and ours' metadata against stock's."""

import json
import subprocess
import sys

import pytest

from ckptdoctor.check.layout import Layout
from ckptdoctor.check.mova_shape import MovaShape
from ckptdoctor.check.state_dicts import mova_specs

from support.fake_ranks import leave_fake_world
from support.metadata import describe_metadata, listed_items, written_items

SHAPE = MovaShape().with_layers(12)


def run_simulate_job(job: dict) -> dict:
    out = subprocess.run([sys.executable, "-m", "ckptdoctor.check.jobs", json.dumps(job)], capture_output=True,
                         text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.parametrize("layout,ranks,sample", [("fsdp", 64, [1, 17, 63]), ("hsdp:8", 64, [9, 30, 63])])
@pytest.mark.parametrize("save", ["model", "optimizer"])
def test_derived_plans_equal_constructed_ones_on_sampled_ranks(layout, ranks, sample, save):
    job = {"kind": "verify", "shape": SHAPE.__dict__, "mode": "sft", "layout": layout, "save": save,
           "ranks": ranks, "sample_ranks": sample}
    assert run_simulate_job(job)["ranks_checked"] == sample


def test_a_wrong_derivation_is_caught():
    """verify_derivation must be able to fail: compare against a different layout's plans."""
    from ckptdoctor.check import save_phases as simulate

    specs = mova_specs(SHAPE, "sft")
    original = simulate.derive_plan
    try:
        simulate.derive_plan = lambda plan0, planner0, rank, ranks, layout: plan0  # "every rank = rank 0"
        with pytest.raises(AssertionError, match="rank 3: derived plan differs"):
            simulate.verify_derivation("model", specs, 8, Layout.parse("fsdp"), [3])
    finally:
        simulate.derive_plan = original
        leave_fake_world()


@pytest.mark.parametrize("layout", ["fsdp", "hsdp:4"])
@pytest.mark.parametrize("mode", ["sft", "lora"])
def test_ours_describes_the_same_checkpoint_as_stock_for_mova_shapes(layout, mode):
    """MOVA's structure at 16 ranks (tiny widths, so many tensors are narrower than the shard
    group and share empty chunks): same tensors, chunks and bytes, each item written once."""
    from torch.distributed.checkpoint import DefaultSavePlanner

    from ckptdoctor.fix.planner import build_metadata
    from ckptdoctor.check.fake_world import init_fake_world
    from ckptdoctor.check.save_phases import _default_metadata, rank_plans, scalable_local_plan
    from ckptdoctor.check.state_dicts import build_state_dict

    specs = mova_specs(SHAPE, mode)
    try:
        for save in ("model", "optimizer"):
            stock = list(rank_plans(save, specs, 16, Layout.parse(layout), "stock"))
            ours = list(rank_plans(save, specs, 16, Layout.parse(layout), "ours"))
            _, stock_md = _default_metadata(DefaultSavePlanner()._dedup_save_plans(stock))
            ours_md = build_metadata(ours)
            assert describe_metadata(ours_md) == describe_metadata(stock_md)
            chunks = sum(1 if d == "bytes" else len(d[-1]) for d in describe_metadata(ours_md).values())
            assert sum(len(p.items) for p in ours) == chunks  # every item written exactly once
            planner, _ = scalable_local_plan(build_state_dict(save, specs, Layout.parse(layout),
                                                              init_fake_world(0, 16, Layout.parse(layout))))
            derived = planner.derived_metadata()
            assert describe_metadata(derived) == describe_metadata(stock_md)  # rank 0 alone, from its own state dict
            assert sorted(written_items(ours)) == sorted(listed_items(derived))  # what is listed is what is written
            assert sum(len(p.items) for p in stock) > chunks  # and stock did ship duplicates
    finally:
        leave_fake_world()

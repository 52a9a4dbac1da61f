"""The simulator in one process: derivation by symmetry, cost laws, bad input."""

import json
import subprocess
import sys

import pytest

from ckptdoctor.check.layout import Layout
from ckptdoctor.check.mova_shape import MovaShape
from ckptdoctor.check.state_dicts import mova_specs
from ckptdoctor.errors import BadLayout

from support.fake_ranks import leave_fake_world
from support.metadata import describe_metadata, listed_items, written_items

SHAPE = MovaShape().with_layers(12)


def run_simulate_job(job: dict) -> dict:
    out = subprocess.run([sys.executable, "-m", "ckptdoctor.check.rank0", json.dumps(job)], capture_output=True,
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
    from ckptdoctor.check import rank0 as simulate

    specs = mova_specs(SHAPE, "sft")
    original = simulate.derive_plan
    try:
        simulate.derive_plan = lambda plan0, planner0, rank, ranks, layout: plan0  # "every rank = rank 0"
        with pytest.raises(AssertionError, match="rank 3: derived plan differs"):
            simulate.verify_derivation("model", specs, 8, Layout.parse("fsdp"), [3])
    finally:
        simulate.derive_plan = original
        leave_fake_world()


# The cost model's laws against a measured, unfitted point (CPU-time laws) are benchmarks/cost_model_laws.py.


def test_extrapolation_follows_the_line_and_never_lowers_a_peak():
    """scaling._on_the_line: every phase and total on the line through the two largest x
    (N, or the items written at N), and the peak memory floored at the largest measured."""
    from ckptdoctor.check.cost_model import _on_the_line

    def at(n, seconds, peak):
        return {"phase_s": {"validate": seconds}, "bytes_to_rank0": 10 * n, "peak_mem_bytes": peak}

    coord = {8: at(8, 9.0, 1), 16: at(16, 1.0, 500), 32: at(32, 3.0, 400)}
    phase_s, totals = _on_the_line(coord, 64, ("bytes_to_rank0", "peak_mem_bytes"))
    assert phase_s == {"validate": 7.0}  # through N=16 and 32; N=8 is ignored
    assert totals == {"bytes_to_rank0": 640, "peak_mem_bytes": 500}  # the line says 200: floored
    phase_s, _ = _on_the_line(coord, 3000, ("peak_mem_bytes",), x_of={8: 100, 16: 1000, 32: 2000}.get)
    assert phase_s == {"validate": 5.0}  # placed at the items written, not at N


@pytest.mark.parametrize("text", ["ddp", "hsdp:", "hsdp:0", "hsdp:x", "fsdp:8"])
def test_unknown_layouts_are_rejected(text):
    with pytest.raises(BadLayout, match="unknown layout"):
        Layout.parse(text)


def test_rank_counts_that_cannot_hold_the_layout_are_rejected():
    with pytest.raises(BadLayout, match="1144 ranks are not divisible by the shard group of 48"):
        Layout.parse("hsdp:48").check(1144)
    with pytest.raises(BadLayout, match="at least 1"):
        Layout.parse("fsdp").check(0)


@pytest.mark.parametrize("args,message", [
    (["--layout", "tp:2"], "unknown layout 'tp:2'"),
    (["--ranks", "1144", "--layout", "hsdp:48"], "not divisible by the shard group"),
    (["--ranks", "0"], "at least 1"),
    (["--ranks", "8,x"], "comma-separated integers"),
])
def test_simulate_cli_bad_input_is_one_clear_line(args, message):
    proc = subprocess.run([sys.executable, "-m", "ckptdoctor.cli", "simulate", *args], capture_output=True, text=True)
    assert proc.returncode != 0
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("args,message", [
    (["--ranks", "1144", "--torch", "2.9.0"], "--torch 2.9.0: this interpreter has torch"),
    (["--ranks", "1144", "--layout", "hsdp:48"], "not divisible by the shard group"),
    (["--ranks", "8", "--warn-fraction", "2"], "--warn-fraction must be in (0, 1]"),
])
def test_check_bad_input_is_one_clear_line(args, message):
    proc = subprocess.run([sys.executable, "-m", "ckptdoctor.cli", "check", *args], capture_output=True, text=True)
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("layout", ["fsdp", "hsdp:4"])
@pytest.mark.parametrize("mode", ["sft", "lora"])
def test_ours_describes_the_same_checkpoint_as_stock_for_mova_shapes(layout, mode):
    """MOVA's structure at 16 ranks (tiny widths, so many tensors are narrower than the shard
    group and share empty chunks): same tensors, chunks and bytes, each item written once."""
    from torch.distributed.checkpoint import DefaultSavePlanner

    from ckptdoctor.fix.planner import build_metadata
    from ckptdoctor.check.rank0 import _default_metadata, init_fake_world, rank_plans, scalable_local_plan
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

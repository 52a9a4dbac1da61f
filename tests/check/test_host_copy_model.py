"""An async save's host copy at N ranks (check/host_copy_model.py): rank 0's bytes of each save,
counted by hand here. Against a real copy: tests/selftest/test_selftest.py (`selftest --async`'s
rank 0 copy equals this model's count from the checkpoint it wrote); through the CLI:
tests/acceptance/test_tools_from_any_directory.py (`check --async`)."""

import pytest

from ckptdoctor.check.host_copy_model import format_lines, host_copies, predict, rank0_share
from ckptdoctor.check.jobs import Workload
from ckptdoctor.check.layout import Layout
from ckptdoctor.check.state_dicts import ParameterSpecs

# (fqn, shape, sharded by FSDP, trainable): a trained sharded weight, a frozen sharded weight
# (LoRA's base), a frozen replicated one (an FSDP-ignored text encoder)
SPECS = ParameterSpecs([("w", (10, 3), True, True), ("base", (7, 2), True, False), ("text", (5,), False, False)])


@pytest.fixture
def specs_workload(monkeypatch):
    monkeypatch.setattr("ckptdoctor.check.host_copy_model.job_specs", lambda source: SPECS)
    return Workload(ranks=[4], layouts=[Layout.parse("fsdp")])


def test_rank0_holds_the_ceiling_of_dim_0_over_the_shard_group():
    assert rank0_share((10, 3), 4) == 3 * 3
    assert rank0_share((3, 2), 8) == 1 * 2  # ranks past the end hold nothing; rank 0 holds a row
    assert rank0_share((), 8) == 1  # a 0-dim tensor (AdamW's step): whole


def test_trained_fp32_frozen_bf16_moments_of_trained_only_and_replicas_whole(specs_workload):
    model, optimizer = host_copies(specs_workload, Layout.parse("fsdp"), 4)
    # model: w 3 rows x 3 x 4 B; base 2 rows x 2 x 2 B; text whole, 5 x 2 B on every rank
    assert (model.save, model.sharded, model.replicated) == ("model", 36 + 8, 10)
    # optimizer: w's two moments, 3 x 3 x 4 B each; one fp32 step; nothing for frozen ones
    assert (optimizer.save, optimizer.sharded, optimizer.replicated) == ("optimizer", 72, 4)


def test_hsdp_shards_over_the_shard_group_only_so_the_copy_does_not_shrink_with_replicas(specs_workload):
    at_8, at_64 = (host_copies(specs_workload, Layout.parse("hsdp:2"), n) for n in (8, 64))
    assert at_8 == at_64
    assert at_8[0].sharded == 5 * 3 * 4 + 4 * 2 * 2  # w: 5 of 10 rows; base: 4 of 7


def test_the_record_scales_per_node_and_its_stall_range_by_the_rate(specs_workload):
    record = predict(specs_workload, Layout.parse("fsdp"), 4, ranks_per_node=8, rate=10.0)
    per_rank = 36 + 8 + 10 + 72 + 4
    assert record["per_rank_bytes"] == per_rank
    assert record["ranks_per_node"] == 4 and record["per_node_bytes"] == 4 * per_rank  # 4 ranks: one node
    assert record["stall_copy_s"] == [per_rank / 10.0, 4 * per_rank / 10.0]
    lines = format_lines(record, {"model": 0.5, "optimizer": 1.5}, {"model": 2.0, "optimizer": 3.0},
                         (2000, "MemAvailable"))
    assert lines[1].split() == ["model", "54", "B", "(44", "B", "its", "shards,", "10", "B", "replicated", "on",
                                "every", "rank)"]
    assert "per rank 130 B, per node of 4 rank(s) 520 B; this host has 2 KB free (MemAvailable)" in lines[3]
    assert lines[5].endswith("(model + optimizer: 0.50 s + 1.50 s), the write, and rank 0's finish (2.00 s + 3.00 s)")

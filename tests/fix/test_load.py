"""The load side of the fix on real gloo ranks: ScalableLoadPlanner + ScalableFileSystemReader
read stock-written and ours-written checkpoints bit for bit, at the saving world size and at
others, with stock's read plan item for item; ScalableCheckpointing.load_state refuses a
damaged checkpoint with one line naming the file, on every rank, without hanging."""

import re

import pytest

from ckptdoctor.fix.agreement import OK
from ckptdoctor.fix.index import INDEX_NAME, read_metadata_file, write_index

from test_checkpointing import checkpoint_job
from test_planner import run, saves

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """One checkpoint per writer, saved by 4 ranks: ours (with its index), stock (without), and the
    same stock checkpoint with an index written afterwards, as load_state does for it."""
    root = tmp_path_factory.mktemp("saved")
    saves(root, 4, {root / "ours": "ours+writer", root / "stock": "stock", root / "stock-indexed": "stock"})
    write_index(root / "stock-indexed", read_metadata_file(root / "stock-indexed"))
    return root


@pytest.mark.parametrize("writer, world", [("ours", 4), ("ours", 2), ("ours", 8), ("stock", 8), ("stock-indexed", 2)])
def test_loads_bit_exactly_with_stocks_read_plan_at_any_world_size(saved, tmp_path, writer, world):
    assert (saved / writer / INDEX_NAME).exists() == (writer != "stock")
    reports = run(tmp_path, world, "load", saved / writer, "ours")
    assert [r["mismatches"] for r in reports] == [[]] * world  # every value, bit for bit
    assert [r["plan_equals_stock"] for r in reports] == [True] * world, reports[0]["plan_difference"]
    assert all(r["items_read"] > 0 for r in reports)


@pytest.fixture(scope="module")
def loads(tmp_path_factory):
    """One 4-rank job loads every problem in turn (the job's LOAD_PROBLEMS), each in its own root."""
    result, reports, _ = checkpoint_job(tmp_path_factory.mktemp("loads"), "loads")
    assert result.returncodes == [0] * 4 and result.torn_down == [], "every rank ends on its own"
    assert {r["status"] for r in reports.values()} == {"ok"}, reports[0].get("error")
    return {problem: {rank: r["loads"][problem] for rank, r in reports.items()} for problem in reports[0]["loads"]}


@pytest.mark.parametrize("problem", ["none", "stock", "empty-index"])
def test_load_state_reads_its_own_and_stocks_checkpoints_back(loads, problem):
    """"empty-index": the index is derived data; an empty one is rebuilt, never a refusal."""
    reports = loads[problem]
    assert {r["status"] for r in reports.values()} == {"ok"}, reports[0].get("error")
    assert all(r["state_is_the_saved_one"] for r in reports.values())
    assert reports[0]["indexed"] == ["optimizer_0", "pytorch_model_fsdp_0"]  # a stock checkpoint: indexed at load


@pytest.mark.parametrize("problem, line", [
    ("missing-metadata", r"not a complete checkpoint \(.*/pytorch_model_fsdp_0/\.metadata is missing\)"),
    ("truncated-metadata", r"not loading .*: .*/pytorch_model_fsdp_0/\.metadata is truncated or corrupt"),
    ("data-file-missing", r"not loading .*: .*/pytorch_model_fsdp_0/__1_0\.distcp is missing"),
    ("misspelt", r"checkpoint aborted at 'check the checkpoint': rank\(s\) 0-3: .*/step-1/acelerator is not a "
                 r"complete checkpoint"),
    ("extra-key", r"loading .* failed on rank\(s\) 0, 1, 2, 3: Missing key in checkpoint state_dict: model\.extra"),
])
def test_a_damaged_checkpoint_is_refused_on_every_rank_in_one_line_naming_it(loads, problem, line):
    reports = loads[problem]
    assert {r["error_type"] for r in reports.values()} == {"CheckpointAborted"}
    assert len({r["error"] for r in reports.values()}) == 1  # the same line on every rank
    for report in reports.values():
        assert "\n" not in report["error"]
        assert re.search(line, report["error"]), report["error"]


def test_a_stock_checkpoint_on_a_read_only_mount_loads_without_its_index(saved, tmp_path, caplog):
    """REAL fault: a read-only bind mount (EROFS for root too). Rank 0 cannot write the index it
    would make for a stock checkpoint: it says so once and every rank reads `.metadata` instead."""
    import logging
    import shutil

    from ckptdoctor.fix.load_check import prepare_for_load

    from support.faults import read_only_bind

    state = tmp_path / "state"
    shutil.copytree(saved / "stock", state / "optimizer_0")
    with read_only_bind(state / "optimizer_0"):  # the checkpoint; the jobs' reports go beside it
        with caplog.at_level(logging.INFO, logger="ckptdoctor"):
            assert prepare_for_load(state) == OK
        assert "stays without an index (" in caplog.text and "Read-only file system" in caplog.text
        reports = run(tmp_path, 4, "load", state / "optimizer_0", "ours")
        assert [r["mismatches"] for r in reports] == [[]] * 4  # every value, bit for bit
    assert not (state / "optimizer_0" / INDEX_NAME).exists()


def test_a_truncated_data_file_is_named_before_any_rank_reads(saved, tmp_path):
    import shutil

    from ckptdoctor.fix.load_check import prepare_for_load

    state = tmp_path / "state"
    shutil.copytree(saved / "ours", state / "optimizer_0")
    data = sorted((state / "optimizer_0").glob("*.distcp"))[-1]
    size = data.stat().st_size
    with open(data, "r+b") as f:
        f.truncate(size - 1)
    assert prepare_for_load(state) == f"{data} is truncated: {size - 1} bytes, its chunks reach {size}"

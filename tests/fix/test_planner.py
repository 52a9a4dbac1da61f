"""ScalableSavePlanner: same checkpoint as stock, each item written once, stock-loadable, reshardable."""

import collections
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata)
from torch.distributed.checkpoint.planner import SavePlan

from ckptdoctor.fix.planner import coverage_problems
from ckptdoctor.fix.validation import validate_chunks
from ckptdoctor.fix.storage import ScalableFileSystemReader
from ckptdoctor.repro.launcher import launch

from support.fake_ranks import planned_as_every_rank, random_state_dicts, saved_as_every_rank
from support.metadata import describe_metadata, listed_items, metadata_of, written_items
from support.paths import JOBS

JOB = JOBS / "planner_job.py"


# -- random state dicts: rank 0's derived metadata is stock's, and is what ranks write ---

@settings(max_examples=200, deadline=None)
@given(random_state_dicts(), st.booleans(), st.booleans())
def test_both_paths_give_stocks_metadata_and_list_exactly_what_ranks_write(case, derive, lowest):
    from torch.distributed.checkpoint import DefaultSavePlanner

    from ckptdoctor.fix.planner import ScalableSavePlanner

    _, stock_md = saved_as_every_rank(case, lambda: DefaultSavePlanner(dedup_save_to_lowest_rank=lowest))
    planners, ours_md = saved_as_every_rank(case, lambda: ScalableSavePlanner(derive_metadata=derive,
                                                                             dedup_save_to_lowest_rank=lowest))
    assert {p.mode for p in planners} == {"derived" if derive else "owned"}
    assert describe_metadata(ours_md) == describe_metadata(stock_md)
    assert validate_chunks(ours_md) == []
    written = written_items(p.plan for p in planners)
    assert sorted(written) == sorted(listed_items(ours_md))  # nothing unwritten, nothing twice
    assert coverage_problems(ours_md, written) == []


def test_coverage_problems_name_a_gap_a_duplicate_and_an_extra():
    md = metadata_of((4,), [((0,), (2,)), ((2,), (2,))])
    assert coverage_problems(md, [("t", (0,)), ("t", (2,))]) == []
    assert coverage_problems(md, [("t", (0,))]) == ["t@(2,): written 0 times"]
    assert coverage_problems(md, [("t", (0,)), ("t", (2,)), ("t", (2,))]) == ["t@(2,): written 2 times"]
    assert coverage_problems(md, [("t", (0,)), ("t", (2,)), ("u", ())]) == ["u@(): written but not listed"]


# -- real gloo jobs: save, compare with stock, load at other world sizes -----------------

def run(tmp_path: Path, world: int, *args, env=None) -> list[dict]:
    result = launch([str(JOB), *map(str, args)], world, tmp_path / f"{args[0]}-{world}.log", timeout_s=300, env=env)
    assert result.returncodes == [0] * world, (tmp_path / f"{args[0]}-{world}.log").read_text()[-3000:]
    return [json.loads(Path(f"{args[1]}.{args[0]}.rank{r}.json").read_text()) for r in range(world)]


def saves(tmp_path: Path, world: int, planners: dict, env=None) -> dict[Path, list[dict]]:
    """One launch saves the same state into each directory with its planner, in order; each one's reports."""
    run(tmp_path, world, "save", *[part for path, how in planners.items() for part in (path, how)], env=env)
    return {path: [json.loads(Path(f"{path}.save.rank{r}.json").read_text()) for r in range(world)]
            for path in planners}


def described(path: Path) -> dict:
    return describe_metadata(FileSystemReader(str(path)).read_metadata())


READ_WITHOUT_CKPTDOCTOR = """
import json, sys
class NoCkptdoctor:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "ckptdoctor":
            raise ImportError("the checkpoint must not need ckptdoctor")
sys.meta_path.insert(0, NoCkptdoctor())
from torch.distributed.checkpoint import FileSystemReader
md = FileSystemReader(sys.argv[1]).read_metadata()
print(json.dumps(sorted([k.fqn, list(k.offset or ()), k.index, v.relative_path, v.offset, v.length]
                        for k, v in md.storage_data.items()), default=str))
"""


def stock_index(path: Path) -> list:
    """The storage index as stock torch reads it: (fqn, offset, index hint, file, offset, length)."""
    out = subprocess.run([sys.executable, "-I", "-c", READ_WITHOUT_CKPTDOCTOR, str(path)], capture_output=True,
                         text=True, check=True).stdout
    return [row[:2] + row[3:] for row in json.loads(out)]  # stock leaves hints unset on our un-rewritten plans


def writers(path: Path) -> dict[str, list[str]]:
    """Per item (key@offsets), the files that hold it, from the metadata's storage index."""
    md = FileSystemReader(str(path)).read_metadata()
    held = collections.defaultdict(list)
    for index, info in md.storage_data.items():
        held[f"{index.fqn}@{tuple(index.offset) if index.offset is not None else ()}"].append(info.relative_path)
    return held


@pytest.mark.slow
def test_same_checkpoint_as_stock_each_item_written_once_and_it_reshards_8_4_8(tmp_path):
    ours, stock, resaved = tmp_path / "ours", tmp_path / "stock", tmp_path / "resaved"
    reports = saves(tmp_path, 8, {ours: "ours+writer", stock: "stock", tmp_path / "owned": "ours-owned",
                                  tmp_path / "stock-writer": "ours"})
    saved, owned, stock_writer = reports[ours], reports[tmp_path / "owned"], reports[tmp_path / "stock-writer"]
    assert [r["mode"] for r in saved] == ["derived"] * 8  # rank 0 described every rank's chunks alone
    assert [r["mode"] for r in owned] == ["owned"] * 8
    assert described(ours) == described(stock) == described(tmp_path / "owned")
    # the columnar finish: the storage index FileSystemWriter writes for the same plan, read by
    # stock torch in an interpreter that cannot import ckptdoctor
    assert stock_index(ours) == stock_index(tmp_path / "stock-writer")
    assert [r["returned_storage_data"] for r in saved] == [None] * 8
    assert all(r["returned_storage_data"] for r in stock_writer)
    held = writers(ours)
    md = FileSystemReader(str(ours)).read_metadata()
    chunks = sum(1 if isinstance(v, BytesStorageMetadata) else len(v.chunks) for v in md.state_dict_metadata.values())
    assert len(held) == chunks and all(len(files) == 1 for files in held.values())  # every item exactly once
    assert sum(r["items_written"] for r in saved) == chunks  # and no rank wrote an item twice
    plain_writers = {files[0] for key, files in held.items() if key.startswith(("plain.", "param_groups."))}
    assert len(plain_writers) > 1, "replicated items should be spread over ranks, not all on rank 0"
    loaded4 = run(tmp_path, 4, "load-save", ours, resaved)  # 8 -> 4 with stock dcp.load, saved again at 4
    assert all(r["mismatches"] == [] for r in loaded4)
    loaded8 = run(tmp_path, 8, "load", resaved)  # 4 -> 8
    assert all(r["mismatches"] == [] for r in loaded8)


@pytest.mark.slow
def test_the_broadcast_back_is_slim_after_our_writer_and_stock_after_stocks(tmp_path):
    """dcp.save returns rank 0's metadata on every rank: after ScalableFileSystemWriter it has
    keys, sizes and dtypes only (at FSDP over N ranks the chunk lists are O(N) per tensor)."""
    reports = saves(tmp_path, 4, {tmp_path / "ours": "ours+writer", tmp_path / "plain": "ours"})
    ours, stock_writer = reports[tmp_path / "ours"], reports[tmp_path / "plain"]
    assert [r["returned_chunks"] for r in ours[1:]] == [0, 0, 0]
    assert all(r["returned_chunks"] > 0 for r in stock_writer)
    # storage_meta (checkpoint_id, save_id) as stock sets it: in the return value and in what readers see
    assert {r["returned_checkpoint_id"] for r in ours + stock_writer} == {str(tmp_path / "ours"), str(tmp_path / "plain")}
    assert [r["returned_checkpoint_id"] for r in ours] == [str(tmp_path / "ours")] * 4
    for reader in (ScalableFileSystemReader(str(tmp_path / "ours")), FileSystemReader(str(tmp_path / "ours"))):
        assert str(reader.read_metadata().storage_meta.checkpoint_id) == str(tmp_path / "ours")


USED_ALONE = {  # what real jobs hold that rank 0 alone cannot derive, and the path every rank agrees on
    "a-key-on-one-rank": ({"EXTRA_KEY_ON_RANK": "1"}, "owned"),
    "a-pipeline-stage-only-its-ranks-hold": ({"STAGE": "1"}, "owned"),
    "a-sub-mesh-dtensor": ({"SUBMESH": "1"}, "owned"),
    "ranks-holding-nothing-of-a-tensor": ({"UNEVEN": "1"}, "derived"),
}


@pytest.mark.slow
@pytest.mark.parametrize("kind", USED_ALONE)
def test_used_alone_the_planner_saves_what_stock_saves_and_stock_loads_it_back(tmp_path, kind):
    """dcp.save with our planner (with our writer, and with stock's), no ScalableCheckpointing:
    the ranks agree on the path before planning, so nothing is refused where stock saves."""
    env, path = USED_ALONE[kind]
    ours, alone, stock = tmp_path / "ours", tmp_path / "planner-alone", tmp_path / "stock"
    reports = saves(tmp_path, 4, {ours: "ours+writer", alone: "ours", stock: "stock"}, env=env)
    for saved in (ours, alone):
        assert [r.get("failed") for r in reports[saved]] == [None] * 4, reports[saved][0].get("error")
        assert [r["mode"] for r in reports[saved]] == [path] * 4
        assert described(saved) == described(stock)
        assert all(len(files) == 1 for files in writers(saved).values())  # each item written once
    log = (tmp_path / "save-4.log").read_text()
    assert log.count("so the save takes the owned path") == (2 if path == "owned" else 0)  # rank 0, once a save
    loaded = run(tmp_path, 4, "load", ours, env=env)  # stock dcp.load, every value compared bit for bit
    assert all(r["mismatches"] == [] for r in loaded)
    if kind == "a-key-on-one-rank":  # the key only rank 1 holds is saved, with its bytes
        only = {"plain": {"only_here": torch.zeros(3)}}
        torch.distributed.checkpoint.load(only, storage_reader=FileSystemReader(str(ours)))
        assert torch.equal(only["plain"]["only_here"], torch.ones(3))


@pytest.fixture(scope="module")
def faulty_saves(tmp_path_factory):
    """One 4-rank launch per injected fault, saving with each planner in turn: (directory, reports) by planner."""
    faults = {"FAIL_PLANNING_ON_RANK": ("ours+writer", "ours-owned+writer", "ours"),
              "DROP_WRITE_ON_RANK": ("ours+writer", "ours")}
    found = {}
    for fault, planners in faults.items():
        root = tmp_path_factory.mktemp(fault.lower())
        paths = {root / planner: planner for planner in planners}
        for path, reports in saves(root, 4, paths, env={fault: "2" if fault.startswith("FAIL") else "1"}).items():
            found[fault, paths[path]] = path, reports
    return found


@pytest.mark.slow
@pytest.mark.parametrize("planner", ["ours+writer", "ours-owned+writer", "ours"])
def test_a_rank_failing_in_planning_fails_every_rank_at_once_and_nothing_is_written(faulty_saves, planner):
    """No collective of the planner's own: the failing rank's exception reaches every rank
    through DCP's own gather and scatter, as with stock (a group timeout of 120 s)."""
    path, reports = faulty_saves["FAIL_PLANNING_ON_RANK", planner]
    assert [r["failed"] for r in reports] == [["RuntimeError"]] * 4
    assert all("injected planning failure on rank 2" in r["error"] for r in reports)  # not a group timeout's
    assert not (path / ".metadata").exists()


@pytest.mark.slow
@pytest.mark.parametrize("planner", ["ours+writer", "ours"])
def test_an_ownership_slip_fails_the_save_before_the_metadata_is_written(faulty_saves, planner):
    """A chunk the metadata lists but no rank wrote: stock would find out at load (KeyError)."""
    path, reports = faulty_saves["DROP_WRITE_ON_RANK", planner]
    assert [r["failed"] for r in reports] == [["IncompleteWrite"]] * 4
    assert "written 0 times" in reports[0]["error"]
    assert not (path / ".metadata").exists()


@pytest.mark.slow
def test_replicas_that_differ_are_refused_by_name_when_asked_and_one_copy_kept_otherwise(tmp_path):
    env = {"DIFFER_ON_RANK": "2", "VERIFY_REPLICAS": "1"}
    refused = run(tmp_path, 4, "save", tmp_path / "checked", "ours+writer", env=env)
    assert [r["failed"] for r in refused] == [["ReplicasDiffer"]] * 4
    assert "plain.lora: ranks 0,1,3 vs 2" in refused[0]["error"]
    assert not (tmp_path / "checked" / ".metadata").exists()
    saved = run(tmp_path, 4, "save", tmp_path / "unchecked", "ours+writer", env={"DIFFER_ON_RANK": "2"})
    assert all("failed" not in r for r in saved)  # as stock: one rank's copy, unchecked


# -- the planner's refusals, one process (torch's fake process group) -------------------------------

CASE = (2, (2,), [((4, 4), (0,))], [(3,)], [])  # 2 ranks, fsdp: a sharded DTensor and one plain tensor


def planned():
    """(planner, local plan) of both ranks of CASE, as DCP leaves them before the plan gather."""
    from ckptdoctor.fix.planner import ScalableSavePlanner

    return [(planner, plan) for _, planner, plan in planned_as_every_rank(CASE, ScalableSavePlanner)]


def test_a_rank_using_another_planner_is_refused_by_rank_0_before_anything_is_written():
    from ckptdoctor.fix.planner import NotDerivable

    (planner0, plan0), (_, plan1) = planned()
    stock = SavePlan(plan1.items)  # what DefaultSavePlanner sends: no handshake
    with pytest.raises(NotDerivable, match="every rank of this save must use ScalableSavePlanner"):
        planner0.create_global_plan([plan0, stock])


def test_two_ranks_reporting_one_global_rank_are_refused():
    import dataclasses

    from ckptdoctor.fix.planner import NotDerivable

    (planner0, plan0), (_, plan1) = planned()
    twin = SavePlan(plan1.items, planner_data=dataclasses.replace(plan1.planner_data,
                                                                  global_rank=plan0.planner_data.global_rank))
    with pytest.raises(NotDerivable, match="two ranks of this save report the same global rank"):
        planner0.create_global_plan([plan0, twin])


def test_a_final_plan_that_is_not_rank_0s_assignment_or_names_an_item_the_rank_lacks_is_refused():
    from ckptdoctor.fix.planner import Assignment, NotDerivable

    (planner0, plan0), (planner1, plan1) = planned()
    with pytest.raises(NotDerivable, match="the plan rank 0 sent is not ScalableSavePlanner's"):
        planner1.finish_plan(SavePlan([]))
    with pytest.raises(NotDerivable, match=r"rank 0 assigned this rank 1 plain item\(s\) it does not hold"):
        planner1.finish_plan(SavePlan([], planner_data=Assignment("derived", plain_keys=("p0", "not_here"))))


@pytest.mark.slow
def test_a_2x2_pipeline_job_with_fsdp2_saves_with_the_planner_alone_and_loads_back_bit_exact_with_stock(tmp_path):
    """torch.distributed.pipelining (GPipe, 2 stages) with fully_shard inside each stage, saved as
    torchtitan saves PP jobs: each stage's own keys, on its own sub-mesh, in one dcp.save."""
    result = launch([str(JOBS / "pipeline_job.py"), str(tmp_path)], 4, tmp_path / "job.log", timeout_s=300)
    assert result.returncodes == [0] * 4, (tmp_path / "job.log").read_text()[-3000:]
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    assert [r["stage"] for r in reports] == [0, 0, 1, 1]
    assert reports[0]["keys"] == reports[1]["keys"] and not set(reports[0]["keys"]) & set(reports[2]["keys"])
    assert [r["mode"] for r in reports] == ["owned"] * 4  # agreed: the stages hold different keys
    assert all(r["compared"] > 20 and r["differ"] == [] and r["nonzero"] > 0 for r in reports)  # bit for bit
    assert described(tmp_path / "ours") == described(tmp_path / "stock")
    assert all(len(files) == 1 for files in writers(tmp_path / "ours").values())

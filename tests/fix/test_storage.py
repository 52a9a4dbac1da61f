"""ScalableFileSystemWriter: its columnar finish writes the storage index stock would, and
refuses writes that do not match the metadata."""

import array
import dataclasses
import pickle

import pytest
from hypothesis import given, settings
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.storage import WriteResult

from ckptdoctor.fix.planner import IncompleteWrite, ScalableSavePlanner
from ckptdoctor.fix.storage import StorageColumns, WrittenItems, _with_storage_columns, columns_coverage_problems

from support.fake_ranks import random_state_dicts, saved_as_every_rank


def results_for(plan, rank: int) -> list[WriteResult]:
    """What FileSystemWriter returns for `plan`: one file per rank, items back to back."""
    out, offset = [], 0
    for i, item in enumerate(plan.items):
        length = 100 + 7 * i + rank
        out.append(WriteResult(index=item.index, size_in_bytes=length,
                               storage_data=_StorageInfo(f"__{rank}_0.distcp", offset, length)))
        offset += length
    return out


def save_as_every_rank(case):
    """(rank 0's metadata, each rank's stock write results, each rank's WrittenItems)."""
    planners, metadata = saved_as_every_rank(case, ScalableSavePlanner)
    results = [results_for(planner.plan, rank) for rank, planner in enumerate(planners)]
    written = [WrittenItems.of(r, planner) for r, planner in zip(results, planners)]
    return metadata, results, written


@settings(max_examples=100, deadline=None)
@given(random_state_dicts())
def test_columnar_storage_index_unpickles_to_the_dict_filesystemwriter_writes(case):
    metadata, results, written = save_as_every_rank(case)
    stock = {r.index: r.storage_data for rank in results for r in rank}
    gathered = pickle.loads(pickle.dumps(written))  # as rank 0 receives them
    assert columns_coverage_problems(metadata, gathered) == []
    blob = pickle.dumps(_with_storage_columns(metadata, StorageColumns(gathered, metadata)))
    assert b"ckptdoctor" not in blob  # stock torch reads it without us
    loaded = pickle.loads(blob)
    assert type(loaded) is Metadata
    assert loaded.storage_data == stock  # keys and values
    assert loaded.state_dict_metadata == metadata.state_dict_metadata
    for key in loaded.storage_data:  # index hints point at the chunk, as stock's rewritten hints do
        if key.index is not None:
            assert metadata.state_dict_metadata[key.fqn].chunks[key.index].offsets == key.offset
    # a mix with stock results: expanded back
    assert {r.index: r.storage_data for w in gathered for r in w.write_results(metadata)} == stock


def test_the_columns_survive_a_dataclasses_replace_copy_as_torch_2_9s_finish_makes():
    """torch 2.9's FileSystemWriter.finish writes `dataclasses.replace(metadata, ...)`, not the object
    it was given; 2.8 and 2.14 write the object itself. Both must pickle the columns."""
    metadata, results, written = save_as_every_rank(CASE)
    stock = {r.index: r.storage_data for rank in results for r in rank}
    given = _with_storage_columns(metadata, StorageColumns(written, metadata))
    for what_finish_writes in (given, dataclasses.replace(given, storage_data={})):
        loaded = pickle.loads(pickle.dumps(what_finish_writes))
        assert type(loaded) is Metadata and loaded.storage_data == stock


CASE = (4, (4,), [((6, 3), (0,)), ((2,), (0,))], [(2,)], [7])  # uneven and empty shards, a plain tensor, an object


def test_columns_check_names_a_missing_a_doubled_and_a_foreign_chunk():
    metadata, _, written = save_as_every_rank(CASE)
    assert columns_coverage_problems(metadata, written) == []
    dropped = [w for w in written]
    dropped[1] = WrittenItems(written[1].paths, *(array.array("q", col[1:]) for col in
                                                 (written[1].key, written[1].chunk, written[1].path,
                                                  written[1].offset, written[1].length)))
    assert any("written 0 times" in p for p in columns_coverage_problems(metadata, dropped))
    assert any("written 2 times" in p for p in columns_coverage_problems(metadata, written + [written[2]]))
    foreign = WrittenItems(["x"], array.array("q", [0]), array.array("q", [99]), array.array("q", [0]),
                           array.array("q", [0]), array.array("q", [1]))
    assert any("not in its list" in p for p in columns_coverage_problems(metadata, written + [foreign]))


def test_stock_writers_are_checked_through_the_metadata_the_planner_returns():
    """FileSystemWriter.finish sets metadata.storage_data, then pickles it: a gap fails there."""
    metadata, results, _ = save_as_every_rank(CASE)
    complete = {r.index: r.storage_data for rank in results for r in rank}
    metadata.storage_data = complete  # accepted
    with pytest.raises(IncompleteWrite, match="written 0 times"):
        metadata.storage_data = dict(list(complete.items())[1:])
    assert type(pickle.loads(pickle.dumps(metadata))) is Metadata  # the file needs no ckptdoctor


def test_other_planners_and_storage_infos_keep_the_stock_results():
    assert WrittenItems.of([], DefaultSavePlanner()) is None
    planners, _ = saved_as_every_rank(CASE, ScalableSavePlanner)
    results = results_for(planners[0].plan, 0)
    assert isinstance(WrittenItems.of(results, planners[0]), WrittenItems)
    results[0].storage_data.transform_descriptors = ["zstd"]  # something the columns do not carry
    assert WrittenItems.of(results, planners[0]) is None

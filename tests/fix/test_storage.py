"""ScalableFileSystemWriter: its columnar finish writes the storage index stock would."""

import pickle
from contextlib import closing

from hypothesis import given, settings
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.storage import WriteResult

from ckptdoctor.fix.planner import ScalableSavePlanner
from ckptdoctor.fix.storage import StorageColumns, WrittenItems, _with_storage_columns

from support.fake_ranks import planned_as_every_rank, random_state_dicts


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
    """(rank 0's derived metadata, each rank's stock write results, each rank's WrittenItems)."""
    results, written = [], []
    for rank, planner, _ in planned_as_every_rank(case, ScalableSavePlanner):
        results.append(results_for(planner.plan, rank))
        written.append(WrittenItems.of(results[-1], planner))
        if rank == 0:
            metadata = planner.derived_metadata()
    return metadata, results, written


@settings(max_examples=100, deadline=None)
@given(random_state_dicts())
def test_columnar_storage_index_unpickles_to_the_dict_filesystemwriter_writes(case):
    metadata, results, written = save_as_every_rank(case)
    stock = {r.index: r.storage_data for rank in results for r in rank}
    gathered = pickle.loads(pickle.dumps(written))  # as rank 0 receives them
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


def test_other_planners_and_storage_infos_keep_the_stock_results():
    planner = DefaultSavePlanner()
    assert WrittenItems.of([], planner) is None
    case = (2, (2,), [((4,), (0,))], [], [])
    _, results, written = save_as_every_rank(case)
    assert all(isinstance(w, WrittenItems) for w in written)
    results[0][0].storage_data.transform_descriptors = ["zstd"]  # something the columns do not carry
    with closing(planned_as_every_rank(case, ScalableSavePlanner)) as ranks:  # leaves the fake world
        _, ours, _ = next(ranks)  # rank 0
        assert WrittenItems.of(results[0], ours) is None

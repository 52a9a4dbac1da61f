"""The checkpoint index (fix/index.py): what it gives back is what `.metadata` says, entry for
entry; and a stale, damaged or missing file is one clear line, never a silent wrong answer."""

import pickle

import pytest
from hypothesis import given, settings
from torch.distributed.checkpoint.filesystem import _StorageInfo

from ckptdoctor.fix.index import (INDEX_NAME, CorruptCheckpoint, NotIndexable, columns_from_storage_data,
                                  data_file_extents, read_index, read_metadata_file, write_index)
from ckptdoctor.fix.storage import index_columns

from support.fake_ranks import random_state_dicts
from support.metadata import describe_metadata
from test_storage import save_as_every_rank


def stock_checkpoint(directory, metadata, results):
    """`directory/.metadata` as FileSystemWriter.finish writes it: the metadata with its storage index."""
    metadata.storage_data = {r.index: r.storage_data for rank in results for r in rank}
    directory.mkdir(exist_ok=True)
    (directory / ".metadata").write_bytes(pickle.dumps(metadata))
    return metadata


@settings(max_examples=60, deadline=None)
@given(random_state_dicts())
def test_the_index_gives_back_every_entry_of_the_metadata(tmp_path_factory, case):
    metadata, results, written = save_as_every_rank(case)
    directory = tmp_path_factory.mktemp("ckpt")
    stock = stock_checkpoint(directory, metadata, results)
    for columns in (None, index_columns(written, stock)):  # from the storage dict, and from the ranks' columns
        write_index(directory, stock, columns)
        indexed = read_index(directory)
        assert describe_metadata(indexed) == describe_metadata(stock)
        assert indexed.planner_data == stock.planner_data
        assert len(indexed.storage_data) == len(stock.storage_data)
        assert {key: indexed.storage_data[key] for key in stock.storage_data} == stock.storage_data
        assert set(indexed.storage_data) == set(stock.storage_data)
        extents = {}
        for info in stock.storage_data.values():
            extents[info.relative_path] = max(extents.get(info.relative_path, 0), info.offset + info.length)
        assert data_file_extents(indexed.storage_data) == extents == data_file_extents(stock.storage_data)


CASE = (4, (2, 2), [((6, 3), (None, 0)), ((8, 4), (0, 1)), ((6, 3), (None, 0))], [(2,)], [7])


def indexed_checkpoint(tmp_path):
    metadata, results, _ = save_as_every_rank(CASE)
    stock = stock_checkpoint(tmp_path, metadata, results)
    write_index(tmp_path, stock)
    return stock


def test_tensors_with_the_same_chunks_share_one_list_in_the_index(tmp_path):
    indexed_checkpoint(tmp_path)
    indexed = read_index(tmp_path)
    assert indexed.state_dict_metadata["d0"].chunks is indexed.state_dict_metadata["d2"].chunks


def test_an_index_of_another_metadata_is_not_used(tmp_path):
    stock = indexed_checkpoint(tmp_path)
    (tmp_path / ".metadata").write_bytes(pickle.dumps(stock) + b"rewritten")
    assert read_index(tmp_path) is None


def test_a_truncated_or_foreign_index_is_one_line_naming_it(tmp_path):
    indexed_checkpoint(tmp_path)
    index = tmp_path / INDEX_NAME
    data = index.read_bytes()
    index.write_bytes(data[:-7])
    with pytest.raises(CorruptCheckpoint, match=f"{index} is truncated"):
        read_index(tmp_path)
    index.write_bytes(b"PK\x03\x04" + data)
    with pytest.raises(CorruptCheckpoint, match=f"{index} is not a ckptdoctor index"):
        read_index(tmp_path)


def test_an_index_without_its_metadata_is_an_unfinished_save(tmp_path):
    indexed_checkpoint(tmp_path)
    (tmp_path / ".metadata").unlink()
    with pytest.raises(CorruptCheckpoint, match=r"\.metadata is missing: the save that wrote"):
        read_index(tmp_path)


def test_a_missing_or_truncated_metadata_is_one_line_naming_it(tmp_path):
    with pytest.raises(CorruptCheckpoint, match=rf"{tmp_path}/\.metadata is missing"):
        read_metadata_file(tmp_path)
    stock = indexed_checkpoint(tmp_path)
    (tmp_path / ".metadata").write_bytes(pickle.dumps(stock)[:100])
    with pytest.raises(CorruptCheckpoint, match=rf"{tmp_path}/\.metadata is truncated or corrupt"):
        read_metadata_file(tmp_path)


def test_transformed_chunks_are_not_indexed(tmp_path):
    stock = indexed_checkpoint(tmp_path)
    key = next(iter(stock.storage_data))
    stock.storage_data[key] = _StorageInfo("__0_0.distcp", 0, 1, transform_descriptors=["zstd"])
    with pytest.raises(NotIndexable, match="transforms"):
        columns_from_storage_data(stock)

"""The checkpoint index (fix/index.py): what it gives back is what `.metadata` says, entry for
entry; and a stale, damaged or missing file is one clear line, never a silent wrong answer."""

import logging
import os
import pickle

import pytest
from hypothesis import given, settings
from torch.distributed.checkpoint.filesystem import _StorageInfo

from ckptdoctor.fix.agreement import OK
from ckptdoctor.fix.index import (INDEX_NAME, CorruptCheckpoint, NotIndexable, columns_from_storage_data,
                                  data_file_extents, read_index, read_metadata_file, write_index)
from ckptdoctor.fix.storage import ScalableFileSystemReader, index_columns

from support.fake_ranks import random_state_dicts
from support.faults import coarse_timestamps
from support.metadata import describe_metadata
from test_storage import save_as_every_rank


def stock_checkpoint(directory, metadata, results):
    """`directory/.metadata` as FileSystemWriter.finish writes it: the metadata with its storage index."""
    metadata.storage_data = {r.index: r.storage_data for rank in results for r in rank}
    directory.mkdir(parents=True, exist_ok=True)
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
    assert [p.name for p in tmp_path.iterdir() if ".tmp" in p.name] == []
    return stock


def test_tensors_with_the_same_chunks_share_one_list_in_the_index(tmp_path):
    indexed_checkpoint(tmp_path)
    indexed = read_index(tmp_path)
    assert indexed.state_dict_metadata["d0"].chunks is indexed.state_dict_metadata["d2"].chunks


def test_an_index_of_another_metadata_is_not_used(tmp_path):
    stock = indexed_checkpoint(tmp_path)
    (tmp_path / ".metadata").write_bytes(pickle.dumps(stock) + b"rewritten")
    assert read_index(tmp_path) is None


def test_same_size_same_time_same_inode_other_content_is_caught_by_the_digest(tmp_path):
    """What 1-second timestamps allow: .metadata rewritten in place with as many bytes, its
    mtime set back. Size, time, device and inode all match; the content does not."""
    indexed_checkpoint(tmp_path)
    path = tmp_path / ".metadata"
    before = path.stat()
    data = bytearray(path.read_bytes())
    data[-2] ^= 0xFF
    with open(path, "r+b") as f:
        f.write(data)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = path.stat()
    assert (after.st_size, after.st_mtime_ns, after.st_ino) == (before.st_size, before.st_mtime_ns, before.st_ino)
    assert read_index(tmp_path) is None


@pytest.mark.parametrize("damage", ["empty", "truncated", "foreign", "old-version", "header"])
def test_a_damaged_index_is_ignored_and_the_reader_falls_back_to_the_metadata(tmp_path, damage, caplog):
    """The index is derived data: damaged, it must never make the fix refuse what stock loads."""
    stock = indexed_checkpoint(tmp_path)
    index = tmp_path / INDEX_NAME
    data = index.read_bytes()
    damaged = {"empty": b"", "truncated": data[:-7], "foreign": b"PK\x03\x04" + data,
               "old-version": data.replace(b'"version": 2', b'"version": 1', 1),
               "header": data.replace(b'"version": 2', b'"version": 2, "x": 1', 1)}[damage]
    index.write_bytes(damaged)
    with caplog.at_level(logging.INFO, logger="ckptdoctor.fix.index"):
        assert read_index(tmp_path) is None
    assert str(index) in caplog.text or "version 1" in caplog.text
    reader = ScalableFileSystemReader(str(tmp_path))
    assert describe_metadata(reader.read_metadata()) == describe_metadata(stock)


def test_prepare_for_load_rebuilds_a_damaged_index(tmp_path):
    from ckptdoctor.fix.load_check import prepare_for_load

    stock = indexed_checkpoint(tmp_path / "accelerator" / "optimizer_0")
    index = tmp_path / "accelerator" / "optimizer_0" / INDEX_NAME
    index.write_bytes(b"")
    for name, extent in data_file_extents(stock.storage_data).items():
        (index.parent / name).write_bytes(b"\0" * extent)
    assert prepare_for_load(tmp_path / "accelerator") == OK
    assert describe_metadata(read_index(index.parent)) == describe_metadata(stock)


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


def test_a_stock_resave_in_the_same_second_on_a_coarse_timestamp_filesystem_is_read_right(tmp_path):
    """Real fault: ext4 with 1-second timestamps on a loop device. The fix's save writes a and b
    (with its index); a stock save of the same keys in the other order rewrites .metadata with
    as many bytes in the same second. Bound by size and mtime only, the index gave a and b
    swapped; now it is not used, and the reader returns what stock does."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

    from ckptdoctor.fix.storage import ScalableFileSystemWriter

    with coarse_timestamps(tmp_path / "coarse") as mount:
        ckpt = mount / "ckpt"
        dcp.save({"a": torch.full((4,), 1.0), "b": torch.full((4,), 2.0)}, storage_writer=ScalableFileSystemWriter(ckpt))
        first = (ckpt / ".metadata").stat()
        dcp.save({"b": torch.full((4,), 4.0), "a": torch.full((4,), 3.0)}, storage_writer=FileSystemWriter(ckpt))
        # INJECTED: both saves in one second of the filesystem's clock. It happens by itself when they
        # are quick enough; setting it makes the test independent of this machine's load (it used to
        # skip itself when two saves took more than a second).
        os.utime(ckpt / ".metadata", ns=(first.st_atime_ns, first.st_mtime_ns))
        second = (ckpt / ".metadata").stat()
        assert (first.st_size, first.st_mtime_ns) == (second.st_size, second.st_mtime_ns)
        assert first.st_mtime_ns % 10**9 == 0  # the filesystem really keeps whole seconds
        assert (ckpt / INDEX_NAME).is_file()
        ours, stock = ({"a": torch.zeros(4), "b": torch.zeros(4)} for _ in range(2))
        dcp.load(ours, storage_reader=ScalableFileSystemReader(ckpt))
        dcp.load(stock, storage_reader=FileSystemReader(ckpt))
        assert torch.equal(stock["a"], torch.full((4,), 3.0)) and torch.equal(stock["b"], torch.full((4,), 4.0))
        assert all(torch.equal(ours[k], stock[k]) for k in "ab")


def test_a_metadata_whose_storage_index_lacks_chunks_or_names_a_stranger_is_corrupt(tmp_path):
    """A `.metadata` a stock writer left inconsistent (a chunk listed with no storage row, or a
    storage row for a key it does not list) is one clear error, never an index with holes."""
    from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

    stock = indexed_checkpoint(tmp_path)
    lacking = dict(stock.storage_data)
    lacking.pop(next(iter(lacking)))
    with pytest.raises(CorruptCheckpoint, match=r"^1 listed chunk\(s\) have no storage entry$"):
        columns_from_storage_data(Metadata(stock.state_dict_metadata, storage_data=lacking))
    index, info = next(iter(stock.storage_data.items()))
    stranger = dict(stock.storage_data) | {MetadataIndex("not_listed", index.offset, index.index): info}
    with pytest.raises(CorruptCheckpoint, match="the storage index names not_listed, which the metadata does not list"):
        columns_from_storage_data(Metadata(stock.state_dict_metadata, storage_data=stranger))

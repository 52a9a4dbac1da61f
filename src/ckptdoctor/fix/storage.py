"""ScalableFileSystemWriter: `FileSystemWriter` whose finish step is not one object per chunk.

After the files are written, stock DCP gathers every rank's `WriteResult`s to rank 0, which
builds `storage_data` (one `MetadataIndex` -> `_StorageInfo` entry per chunk) and pickles it
into the `.metadata` file. With FSDP over all N ranks that is N entries per tensor: ~15
million for MOVA's optimizer at N = 2,816, minutes of rank-0 CPU and tens of GB.

With `ScalableSavePlanner` on its derived path (every rank holds the same keys and rank 0
built the chunk lists), this writer sends each rank's results as columns of integers
(`WrittenItems`), and rank 0 writes `storage_data` as columns too (`StorageColumns`). The
file stays stock: the columns pickle as `dict(zip(map(MetadataIndex, ...), map(_StorageInfo,
...)))`, built only from builtins and torch's own classes, so stock `pickle.load` (and thus
`dcp.load` / `FileSystemReader.read_metadata`) rebuilds exactly the dict `FileSystemWriter`
would have written. Any other planner or result type goes through the stock path.

Before the file is written, `finish` checks that the ranks wrote exactly what the metadata
lists, each (key, chunk) once (a linear pass over the integer columns; on the stock path over
the write results): a gap or a duplicate fails the save, and no `.metadata` is written.

One difference: `dcp.save` broadcasts rank 0's metadata to every rank as its return value.
After this writer wrote the file, the broadcast copy carries keys, sizes and dtypes but no
chunk lists or storage index (`planner.slim`): with FSDP over N ranks those are O(N) per
tensor, and every rank would unpickle them. The file has them all.
"""

from __future__ import annotations

import array
import copyreg
import dataclasses
import logging

import torch
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, MetadataIndex
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from .index import IndexColumns, NotIndexable, read_index, read_metadata_file, row_bases, write_index
from .planner import IncompleteWrite, coverage_problems

log = logging.getLogger(__name__)


class ScalableFileSystemWriter(FileSystemWriter):
    """Drop-in for `FileSystemWriter` (same files, same arguments)."""

    def write_data(self, plan, planner) -> Future:
        results = super().write_data(plan, planner).wait()  # FileSystemWriter writes synchronously
        written = WrittenItems.of(results, planner)
        done = Future()
        done.set_result(results if written is None else written)
        return done

    def finish(self, metadata: Metadata, results: list) -> None:
        self.bytes_written = sum(sum(r.length) if isinstance(r, WrittenItems) else sum(w.size_in_bytes for w in r)
                                 for r in results)  # rank 0: for the one line per save (summary.py)
        if results and all(isinstance(r, WrittenItems) for r in results):
            _raise_on(columns_coverage_problems(metadata, results))
            written = _with_storage_columns(metadata, StorageColumns(results, metadata))
            super().finish(written, [])
            metadata.storage_meta = written.storage_meta  # stock's finish sets it on what it writes: the copy
            columns = index_columns(results, metadata)
        else:
            expanded = [r.write_results(metadata) if isinstance(r, WrittenItems) else r for r in results]
            _raise_on(coverage_problems(metadata, ((r.index.fqn, tuple(r.index.offset or ()))
                                                   for rank in expanded for r in rank)))
            super().finish(metadata, expanded)
            # The index's rows from the write results themselves: FileSystemWriter.finish fills in
            # storage_data on the object it is given (2.8, 2.14) or on a copy of it (2.9).
            metadata.storage_data = {r.index: r.storage_data for rank in expanded for r in rank}
            columns = None  # write_index reads the storage index from metadata.storage_data
        try:
            write_index(self.path, metadata, columns)  # after .metadata: without it, readers read .metadata
        except NotIndexable as reason:
            log.info("ckptdoctor: no index for %s (%s); readers will unpickle .metadata", self.path, reason)
        metadata.__dict__["_written"] = True  # the broadcast that follows sends the slim copy


def index_columns(written: list["WrittenItems"], metadata: Metadata) -> IndexColumns:
    """The index's columns from every rank's integer columns, in one vectorised pass: the row of
    (key, chunk) is the key's first row plus the chunk's position (bytes items: chunk -1, row 0)."""
    keys, bases, rows = row_bases(metadata.state_dict_metadata)
    first_row = torch.tensor([bases[k] for k in keys], dtype=torch.int64)
    path = torch.full((rows,), -1, dtype=torch.int32)
    offset, length = torch.zeros(rows, dtype=torch.int64), torch.zeros(rows, dtype=torch.int64)
    path_ids: dict[str, int] = {}
    for items in written:
        global_path = torch.tensor([path_ids.setdefault(p, len(path_ids)) for p in items.paths] or [0],
                                   dtype=torch.int32)
        row = first_row[_as_tensor(items.key)] + _as_tensor(items.chunk).clamp(min=0)
        path[row] = global_path[_as_tensor(items.path)]
        offset[row], length[row] = _as_tensor(items.offset), _as_tensor(items.length)
    return IndexColumns(list(path_ids), path, offset, length)


def _raise_on(problems: list[str]) -> None:
    if problems:
        raise IncompleteWrite(f"the ranks' writes do not match the metadata ({len(problems)} problem(s): "
                              f"{'; '.join(problems[:5])}); no .metadata was written")


def columns_coverage_problems(metadata: Metadata, written: list["WrittenItems"]) -> list[str]:
    """`planner.coverage_problems` for integer columns, in one vectorised pass: every listed
    (key, chunk) written exactly once; bytes items as chunk -1."""
    keys = sorted(metadata.state_dict_metadata)
    is_bytes = [isinstance(metadata.state_dict_metadata[k], BytesStorageMetadata) for k in keys]
    counts = torch.tensor([1 if b else len(metadata.state_dict_metadata[k].chunks) for k, b in zip(keys, is_bytes)],
                          dtype=torch.int64)
    base = torch.cumsum(counts, 0) - counts
    key = torch.cat([_as_tensor(w.key) for w in written]) if written else torch.zeros(0, dtype=torch.int64)
    chunk = torch.cat([_as_tensor(w.chunk) for w in written]) if written else torch.zeros(0, dtype=torch.int64)
    if key.numel() and (key.min() < 0 or key.max() >= len(keys)):
        return [f"a rank wrote key number {int(key.max())} of {len(keys)}"]
    bytes_key = torch.tensor(is_bytes, dtype=torch.bool)[key]
    bad = torch.where(bytes_key, chunk != -1, (chunk < 0) | (chunk >= counts[key]))
    problems = [f"{keys[k]}: chunk {c} is not in its list" for k, c in zip(key[bad][:5].tolist(), chunk[bad][:5].tolist())]
    slot = base[key] + torch.where(bytes_key, torch.zeros_like(chunk), chunk)
    times = torch.bincount(slot[~bad], minlength=int(counts.sum()))
    for index in torch.nonzero(times != 1).flatten()[:5].tolist():
        k = int(torch.searchsorted(base, index, right=True)) - 1
        problems.append(f"{keys[k]}: chunk {index - int(base[k])} written {int(times[index])} times")
    return problems


def _as_tensor(column: array.array) -> torch.Tensor:
    return torch.frombuffer(bytearray(column), dtype=torch.int64) if len(column) else torch.zeros(0, dtype=torch.int64)


@dataclasses.dataclass
class WrittenItems:
    """One rank's write results as integer columns. `key`: the item's position among the
    save's sorted keys (the same on every rank on the derived path); `chunk`: its chunk's
    position in the metadata's chunk list (-1 for bytes); `path`: index into `paths`."""

    paths: list[str]
    key: array.array
    chunk: array.array
    path: array.array
    offset: array.array
    length: array.array

    @classmethod
    def of(cls, results: list[WriteResult], planner) -> "WrittenItems | None":
        """The columns, or None when this save is not on ScalableSavePlanner's derived path
        or a result carries more than FileSystemWriter's (path, offset, length)."""
        if getattr(planner, "mode", None) != "derived":
            return None
        keys = {fqn: i for i, fqn in enumerate(sorted({item.index.fqn for item in planner.local_items}))}
        paths: dict[str, int] = {}
        columns = cls([], *(array.array("q") for _ in range(5)))
        for result in results:
            info = result.storage_data
            if type(info) is not _StorageInfo or getattr(info, "transform_descriptors", None) is not None:
                return None
            columns.key.append(keys[result.index.fqn])
            columns.chunk.append(planner.chunk_position(result.index.fqn, result.index.offset))
            columns.path.append(paths.setdefault(info.relative_path, len(paths)))
            columns.offset.append(info.offset)
            columns.length.append(info.length)
        columns.paths = list(paths)
        return columns

    def write_results(self, metadata: Metadata) -> list[WriteResult]:
        """Back to stock WriteResults (when other ranks sent stock results)."""
        index = StorageColumns([self], metadata)
        return [WriteResult(index=MetadataIndex(f, o, i), size_in_bytes=n, storage_data=_StorageInfo(p, b, n))
                for f, o, i, p, b, n in zip(index.fqn, index.chunk_offset, index.chunk, index.path, index.offset,
                                            index.length)]


class StorageColumns:
    """`storage_data` for every rank's `WrittenItems`, in columns. Pickles as
    `dict(zip(map(MetadataIndex, fqn, offset, index), map(_StorageInfo, path, offset, length)))`:
    the names repeat as references to one string per key and the offsets as references to
    the metadata's shared chunk offsets, so pickling is a few bytes per entry."""

    def __init__(self, written: list[WrittenItems], metadata: Metadata):
        keys = sorted(metadata.state_dict_metadata)
        offsets = [_chunk_offsets(metadata.state_dict_metadata[k]) for k in keys]
        self.fqn, self.chunk_offset, self.chunk, self.path, self.offset, self.length = [], [], [], [], [], []
        for items in written:
            self.fqn += [keys[k] for k in items.key]
            self.chunk_offset += [offsets[k][c] if c >= 0 else None for k, c in zip(items.key, items.chunk)]
            self.chunk += [c if c >= 0 else None for c in items.chunk]
            self.path += [items.paths[p] for p in items.path]
            self.offset += items.offset.tolist()
            self.length += items.length.tolist()

    def __len__(self) -> int:
        return len(self.fqn)

    def __reduce__(self):
        keys = map(MetadataIndex, self.fqn, self.chunk_offset, self.chunk)
        return dict, (zip(keys, map(_StorageInfo, self.path, self.offset, self.length)),)


def _chunk_offsets(md) -> list:
    return [] if isinstance(md, BytesStorageMetadata) else [chunk.offsets for chunk in md.chunks]


@dataclasses.dataclass
class _MetadataWithStorageColumns(Metadata):
    """Rank 0's metadata while `FileSystemWriter.finish` writes it: pickles as a stock
    `Metadata` (copyreg's own reconstructor) whose storage_data is the columns. The columns are
    a dataclass field so that a `dataclasses.replace` copy (torch 2.9's finish) keeps them."""

    storage_columns: StorageColumns | None = None

    def __reduce_ex__(self, protocol):
        state = dict(self.__dict__)
        state["storage_data"] = state.pop("storage_columns")
        return copyreg._reconstructor, (Metadata, object, None), state


def _with_storage_columns(metadata: Metadata, columns: StorageColumns) -> Metadata:
    fields = {f.name: getattr(metadata, f.name) for f in dataclasses.fields(metadata)}
    return _MetadataWithStorageColumns(**fields, storage_columns=columns)


class ScalableFileSystemReader(FileSystemReader):
    """Drop-in for `FileSystemReader`. With the checkpoint's index (`index.py`: written by
    `ScalableFileSystemWriter`, or by `write_index` for a stock checkpoint), a rank unpickles the
    skeleton of the metadata, whose chunk lists are shared, and reads the storage entries of the
    chunks it loads; without it, `.metadata` as stock does. A missing or damaged file is one
    `CorruptCheckpoint` line naming it."""

    def read_metadata(self, *args, **kwargs) -> Metadata:
        if kwargs.get("rank") is not None:  # torch >= 2.10's rank-local metadata: stock's
            return super().read_metadata(*args, **kwargs)
        metadata = read_index(self.path) or read_metadata_file(self.path)
        if getattr(metadata, "storage_meta", None) is None:
            from torch.distributed.checkpoint.metadata import StorageMeta
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

"""The checkpoint index: each rank reads the part of a DCP checkpoint's metadata it loads.

Stock `FileSystemReader.read_metadata` unpickles the whole `.metadata` on every rank. With FSDP
over N ranks that file lists N chunks per tensor and one storage entry per chunk: for MOVA's
optimizer at N = 2,816 about 19 million entries, gigabytes of Python objects on each of the 8
ranks of a node (docs/root-cause.md, "Resume").

`.ckptdoctor-index`, beside `.metadata` (which stays as it is, for stock readers), holds the same
information in two parts:

* the skeleton: torch's `Metadata` without its storage index, the chunk list of every tensor
  shared with every other tensor that has the same chunks (a few lists instead of one per
  tensor), pickled: what a rank needs to plan its reads;
* the storage index as three fixed-width columns with one row per (key, chunk), keys sorted,
  chunks in their list's order: file number, byte offset, length. A rank reads the rows of the
  chunks it loads (`IndexedStorage`), nothing else.

`ScalableFileSystemWriter` writes the index right after `.metadata`; `write_index` makes one
for a checkpoint stock DCP wrote (once, on one rank, at the cost of one stock unpickle).

The index is derived data: `.metadata` stays the truth. It records the identity (device, inode,
size, mtime) and the sha256 of the `.metadata` it describes; a reader uses it only when both
match (a stock re-save in the same second, on a filesystem with 1-second timestamps, has the
same size and mtime but not the same digest). An index that is stale, damaged, empty or of
another version is not an error: `read_index` says why in the log and returns None, and the
caller reads `.metadata` as stock does (and rank 0 writes the index anew before a load).
"""

from __future__ import annotations

import array
import ctypes
import dataclasses
import hashlib
import json
import logging
import mmap
import os
import pickle
import secrets
import socket
import struct
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import CkptDoctorError
from .metadata_format import newer_format_problem

if TYPE_CHECKING:
    import torch

INDEX_NAME = ".ckptdoctor-index"
METADATA_NAME = ".metadata"
MAGIC = b"ckptdoctor-index\n"
VERSION = 2  # 2: bound to .metadata by identity and sha256 (1: size and mtime only)
log = logging.getLogger(__name__)
COLUMNS = (("path", "i", 4), ("offset", "q", 8), ("length", "q", 8))  # name, array typecode, bytes


class CorruptCheckpoint(CkptDoctorError):
    """A checkpoint file is missing, truncated or unreadable."""


class NotIndexable(CkptDoctorError):
    """The checkpoint stores something the index has no column for (e.g. transformed chunks)."""


@dataclasses.dataclass(frozen=True)
class Header:
    version: int
    metadata_size: int       # the .metadata this index describes: its identity ...
    metadata_mtime_ns: int
    metadata_device: int
    metadata_inode: int
    metadata_sha256: str     # ... and its content
    rows: int
    skeleton_bytes: int

    def column_start(self, header_bytes: int, column: int) -> int:
        start = len(MAGIC) + header_bytes + self.skeleton_bytes
        return start + sum(width for _, _, width in COLUMNS[:column]) * self.rows

    def file_size(self, header_bytes: int) -> int:
        return self.column_start(header_bytes, len(COLUMNS))


# -- the skeleton: keys, sizes, dtypes, shared chunk lists ------------------------------------------

def shared_chunk_lists(state_dict_metadata: dict) -> dict:
    """The same metadata, every tensor's chunk list replaced by one list shared by all tensors with
    the same chunks (already shared lists are recognised by identity, at no cost per chunk)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    by_identity, by_content, out = {}, {}, {}
    for key, md in state_dict_metadata.items():
        if not isinstance(md, TensorStorageMetadata):
            out[key] = md
            continue
        shared = by_identity.get(id(md.chunks))
        if shared is None:
            content = tuple((tuple(c.offsets), tuple(c.sizes)) for c in md.chunks)
            shared = by_identity[id(md.chunks)] = by_content.setdefault(content, md.chunks)
        out[key] = md if shared is md.chunks else TensorStorageMetadata(md.properties, md.size, shared)
    return out


def row_bases(state_dict_metadata: dict) -> tuple[list[str], dict[str, int], int]:
    """(sorted keys, first row of each key, total rows): a tensor has one row per chunk, a bytes
    item one row."""
    keys = sorted(state_dict_metadata)
    bases, rows = {}, 0
    for key in keys:
        bases[key] = rows
        rows += len(getattr(state_dict_metadata[key], "chunks", (None,)))
    return keys, bases, rows


class ChunkPositions:
    """The position of a chunk (by its offsets) in a shared chunk list, one dict per list."""

    def __init__(self):
        self._by_list: dict[int, dict[tuple, int]] = {}

    def __call__(self, chunks: list, offsets, hint: int | None = None) -> int:
        offsets = tuple(offsets)
        if hint is not None and 0 <= hint < len(chunks) and tuple(chunks[hint].offsets) == offsets:
            return hint
        positions = self._by_list.get(id(chunks))
        if positions is None:
            positions = self._by_list[id(chunks)] = {tuple(c.offsets): i for i, c in enumerate(chunks)}
        return positions[offsets]


# -- writing -----------------------------------------------------------------------------------------

@dataclasses.dataclass
class IndexColumns:
    """The storage index as columns, one row per (key, chunk) in `row_bases` order."""

    paths: list[str]
    path: "torch.Tensor"      # int32: index into paths
    offset: "torch.Tensor"    # int64
    length: "torch.Tensor"    # int64


def columns_from_storage_data(metadata) -> IndexColumns:
    """The columns of a stock storage index (`metadata.storage_data`, one entry per chunk)."""
    import torch

    sdm = metadata.state_dict_metadata
    keys, bases, rows = row_bases(sdm)
    position = ChunkPositions()
    path, offset, length = array.array("i", [-1]) * rows, array.array("q", [0]) * rows, array.array("q", [0]) * rows
    path_ids: dict[str, int] = {}
    for index, info in metadata.storage_data.items():
        if getattr(info, "transform_descriptors", None):
            raise NotIndexable(f"{index.fqn} is stored with transforms {info.transform_descriptors}")
        md = sdm.get(index.fqn)
        if md is None:
            raise CorruptCheckpoint(f"the storage index names {index.fqn}, which the metadata does not list")
        row = bases[index.fqn] + (position(md.chunks, index.offset, index.index) if hasattr(md, "chunks") else 0)
        path[row] = path_ids.setdefault(info.relative_path, len(path_ids))
        offset[row], length[row] = info.offset, info.length
    missing = path.count(-1)
    if missing:
        raise CorruptCheckpoint(f"{missing} listed chunk(s) have no storage entry")
    as_tensor = lambda column, dtype: torch.frombuffer(column, dtype=dtype).clone() if rows else \
        torch.zeros(0, dtype=dtype)  # noqa: E731
    return IndexColumns(list(path_ids), as_tensor(path, torch.int32), as_tensor(offset, torch.int64),
                        as_tensor(length, torch.int64))


def metadata_identity(path: Path) -> tuple[int, int, int, int]:
    """(size, mtime_ns, device, inode) of a `.metadata` file."""
    stat = path.stat()
    return stat.st_size, stat.st_mtime_ns, stat.st_dev, stat.st_ino


def sha256_of_file(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def write_index(checkpoint_dir: str | os.PathLike, metadata, columns: IndexColumns | None = None) -> Path:
    """Write `checkpoint_dir/.ckptdoctor-index` for `metadata` (the one in `.metadata`, which must
    exist already), atomically, bound to that file's identity and digest. `columns`: the storage
    index, if the caller has it as columns."""
    directory = Path(checkpoint_dir)
    metadata_path = directory / METADATA_NAME
    size, mtime_ns, device, inode = metadata_identity(metadata_path)
    digest = sha256_of_file(metadata_path)
    sdm = shared_chunk_lists(metadata.state_dict_metadata)
    columns = columns or columns_from_storage_data(metadata)
    skeleton = pickle.dumps({"metadata": _skeleton(metadata, sdm), "paths": columns.paths},
                            protocol=pickle.HIGHEST_PROTOCOL)
    header = Header(VERSION, size, mtime_ns, device, inode, digest, columns.path.numel(), len(skeleton))
    header_line = (json.dumps(dataclasses.asdict(header)) + "\n").encode()
    # unique across hosts sharing the directory, not only across this host's processes
    tmp = directory / f"{INDEX_NAME}.tmp-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"
    with open(tmp, "wb") as f:
        f.write(MAGIC + header_line + skeleton)
        for column in (columns.path, columns.offset, columns.length):
            f.write(_raw_bytes(column))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, directory / INDEX_NAME)
    return directory / INDEX_NAME


def _raw_bytes(tensor) -> bytes:
    """A CPU tensor's bytes, in this host's byte order (little-endian on every host torch ships for),
    without numpy."""
    tensor = tensor.contiguous()
    return ctypes.string_at(tensor.data_ptr(), tensor.numel() * tensor.element_size()) if tensor.numel() else b""


def _skeleton(metadata, state_dict_metadata):
    """torch's own `Metadata` (not a subclass of ours), without the storage index."""
    from torch.distributed.checkpoint.metadata import Metadata

    fields = {f.name: getattr(metadata, f.name) for f in dataclasses.fields(Metadata)}
    return Metadata(**(fields | {"state_dict_metadata": state_dict_metadata, "storage_data": None}))


# -- reading -------------------------------------------------------------------------------------------

def read_index(checkpoint_dir: str | os.PathLike):
    """The checkpoint's metadata from its index, its storage index read on demand; None when there
    is no usable index: none, another version, one bound to another `.metadata`, or a damaged one
    (said in the log). Raises CorruptCheckpoint only when `.metadata` itself is missing."""
    directory = Path(checkpoint_dir)
    index_path, metadata_path = directory / INDEX_NAME, directory / METADATA_NAME
    if not index_path.is_file():
        return None
    try:
        identity = metadata_identity(metadata_path)
    except FileNotFoundError:
        raise CorruptCheckpoint(f"{metadata_path} is missing: the save that wrote {index_path} did not finish") from None
    try:
        return _read_bound_index(index_path, metadata_path, identity)
    except StaleIndex as reason:
        log.info("ckptdoctor: not using %s: %s; reading %s instead", index_path, reason, METADATA_NAME)
    except CorruptCheckpoint as reason:
        log.warning("ckptdoctor: ignoring a damaged index (%s); reading %s instead", reason, METADATA_NAME)
    return None


class StaleIndex(Exception):
    """The index describes another `.metadata`, or was written by another version."""


def _read_bound_index(index_path: Path, metadata_path: Path, identity: tuple):
    if index_path.stat().st_size == 0:
        raise CorruptCheckpoint(f"{index_path} is empty")
    with open(index_path, "rb") as f:
        data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    header, header_bytes = _header(data, index_path)
    if (header.metadata_size, header.metadata_mtime_ns, header.metadata_device, header.metadata_inode) != identity:
        raise StaleIndex(f"{metadata_path} was rewritten after the index")
    if header.metadata_sha256 != sha256_of_file(metadata_path):
        raise StaleIndex(f"{metadata_path} has the same size and time but other content (a re-save)")
    if len(data) != header.file_size(header_bytes):
        raise CorruptCheckpoint(f"{index_path} is truncated: {len(data)} bytes, its header says "
                                f"{header.file_size(header_bytes)}")
    start = len(MAGIC) + header_bytes
    try:
        skeleton = pickle.loads(data[start:start + header.skeleton_bytes])
    except Exception as error:  # noqa: BLE001 - a damaged file, or one a newer torch wrote
        newer = newer_format_problem(index_path, data[start:start + header.skeleton_bytes])
        if newer:
            raise StaleIndex(newer) from error
        raise CorruptCheckpoint(f"{index_path} is unreadable ({type(error).__name__}: {error})") from error
    metadata = skeleton["metadata"]
    metadata.storage_data = IndexedStorage(data, header, header_bytes, metadata.state_dict_metadata,
                                           skeleton["paths"])
    return metadata


def _header(data, path: Path) -> tuple[Header, int]:
    if data[:len(MAGIC)] != MAGIC:
        raise CorruptCheckpoint(f"{path} is not a ckptdoctor index")
    end = data.find(b"\n", len(MAGIC))
    try:
        fields = json.loads(data[len(MAGIC):end + 1])
        if fields.get("version") != VERSION:
            raise StaleIndex(f"it is index version {fields.get('version')}; this ckptdoctor reads {VERSION}")
        header = Header(**fields)
    except (ValueError, TypeError, AttributeError) as error:
        raise CorruptCheckpoint(f"{path} has a damaged header ({error})") from error
    return header, end + 1 - len(MAGIC)


class IndexedStorage(Mapping):
    """`Metadata.storage_data` read from the index's columns, one row per lookup: what
    `FileSystemReader.read_data` asks for, `MetadataIndex -> _StorageInfo`."""

    def __init__(self, data, header: Header, header_bytes: int, state_dict_metadata: dict, paths: list[str]):
        self._data, self._paths, self._sdm = data, paths, state_dict_metadata
        self._keys, self._bases, self._rows = row_bases(state_dict_metadata)
        self._starts = [header.column_start(header_bytes, c) for c in range(len(COLUMNS))]
        self._formats = [struct.Struct("<" + code) for _, code, _ in COLUMNS]
        self._position = ChunkPositions()

    def row(self, index) -> int:
        md = self._sdm[index.fqn]  # KeyError for a key the checkpoint does not hold, as a dict would
        chunks = getattr(md, "chunks", None)
        if chunks is None:
            return self._bases[index.fqn]
        return self._bases[index.fqn] + self._position(chunks, index.offset, index.index)

    def __getitem__(self, index):
        from torch.distributed.checkpoint.filesystem import _StorageInfo

        row = self.row(index)
        path, offset, length = (fmt.unpack_from(self._data, start + row * fmt.size)[0]
                                for fmt, start in zip(self._formats, self._starts))
        return _StorageInfo(self._paths[path], offset, length)

    def __len__(self) -> int:
        return self._rows

    def __iter__(self) -> Iterator:
        from torch.distributed.checkpoint.metadata import MetadataIndex

        for key in self._keys:
            chunks = getattr(self._sdm[key], "chunks", None)
            if chunks is None:
                yield MetadataIndex(key)
            else:
                yield from (MetadataIndex(key, c.offsets, i) for i, c in enumerate(chunks))

    def file_extents(self) -> dict[str, int]:
        """For every data file, the end of its last chunk (offset + length): the size it must have."""
        import torch

        def column(c):
            start, width = self._starts[c], COLUMNS[c][2]
            dtype = torch.int32 if width == 4 else torch.int64
            if not self._rows:
                return torch.zeros(0, dtype=dtype)
            with warnings.catch_warnings():  # read-only map, read only: no copy of a column
                warnings.simplefilter("ignore", UserWarning)
                return torch.frombuffer(self._data, dtype=dtype, count=self._rows, offset=start)

        path, end = column(0).long(), column(1) + column(2)
        extents = torch.zeros(len(self._paths), dtype=torch.int64).scatter_reduce(0, path, end, "amax")
        return dict(zip(self._paths, extents.tolist()))


def data_file_extents(storage) -> dict[str, int]:
    """For every data file a storage index names, the end of its last chunk: the size it must have."""
    if isinstance(storage, IndexedStorage):
        return storage.file_extents()
    extents: dict[str, int] = {}
    for info in storage.values():
        extents[info.relative_path] = max(extents.get(info.relative_path, 0), info.offset + info.length)
    return extents


def read_metadata_file(checkpoint_dir: str | os.PathLike):
    """Stock's read of `.metadata` (every entry unpickled), with one clear line when it fails."""
    path = Path(checkpoint_dir) / METADATA_NAME
    try:
        with open(path, "rb") as f:
            return pickle.load(f)
    except FileNotFoundError:
        raise CorruptCheckpoint(f"{path} is missing: not a DCP checkpoint, or its save did not finish") from None
    except Exception as error:  # noqa: BLE001 - EOFError, UnpicklingError, ...: a damaged file, or a newer format
        newer = newer_format_problem(path, path.read_bytes())
        raise CorruptCheckpoint(newer or f"{path} is truncated or corrupt ({type(error).__name__}: {error})") from error

"""Every rank's chunk of a DTensor, derived on one rank from torch's own chunk function.

A DTensor's local chunk on any rank follows from its global shape, its mesh's shape and its
placements, through torch's `_compute_local_shape_and_global_offset` (the function every rank's
`create_local_plan` calls). So rank 0 can list every rank's chunk without hearing from them
(`MeshIndex.chunks`, one list per distinct (shape, mesh, placements), shared by every tensor that
has it), and each rank can tell, by itself, whether its own chunk is the one rank 0 will derive
(`MeshIndex.not_derivable`). `chunk_table` asks torch's function once per 1-D split where the
placements allow it (FSDP, HSDP, FSDP x TP), not once per rank and shape.

Used by the planner's derived path (planner.py) and by `check` (check/save_phases.py).
"""

from __future__ import annotations

import functools
import hashlib
import itertools

import torch
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                   TensorStorageMetadata)
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType
from torch.distributed.tensor import DTensor, Replicate, Shard


def clear_chunk_caches() -> None:
    """Forget the chunk tables (the simulator times a first save, without them)."""
    chunk_table.cache_clear()
    local_chunk.cache_clear()


def layout_key(value: DTensor) -> tuple:
    return tuple(value.shape), tuple(value.device_mesh.shape), tuple(value.placements)


@functools.lru_cache(maxsize=4096)
def local_chunk(global_shape, mesh_shape, placements, coordinate) -> tuple[tuple, tuple]:
    """(offsets, sizes) of the chunk at `coordinate`: torch's own function, the one
    `create_local_plan` used."""
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    sizes, offsets = _compute_local_shape_and_global_offset(global_shape, mesh_shape, list(coordinate), placements)
    return tuple(offsets), tuple(sizes)


@functools.lru_cache(maxsize=256)
def chunk_table(global_shape, mesh_shape, placements) -> tuple[tuple[tuple, tuple, tuple], ...]:
    """(coordinate, offsets, sizes) for every mesh coordinate whose Replicate coordinates
    are 0 (replicas hold the same chunk), in row-major order.

    When each tensor dim is split by at most one mesh dim (FSDP, HSDP, FSDP x TP), a
    chunk's offset and size along that dim are the 1-D split of that dim by that mesh dim,
    so torch's function is asked once per (dim size, mesh dim size, coordinate), shared by
    every tensor with that dim size, not once per rank and tensor shape (on torch 2.14.1 a
    call costs ~70 us: 5 s per save at N = 2,816). Nested or strided sharding: every
    coordinate is asked."""
    varying = [range(1) if isinstance(p, Replicate) else range(n) for n, p in zip(mesh_shape, placements)]
    split = [p.dim for p in placements if type(p) is Shard]
    if not all(type(p) in (Shard, Replicate) for p in placements) or len(split) != len(set(split)):
        return tuple((c, *local_chunk(global_shape, mesh_shape, placements, c)) for c in itertools.product(*varying))
    along = {}  # (mesh dim, coordinate) -> (offset, size) along the tensor dim it splits: a 1-D split
    for m, p in enumerate(placements):
        for c in range(mesh_shape[m]) if type(p) is Shard else ():
            (offset,), (size,) = local_chunk((global_shape[p.dim],), (mesh_shape[m],), (Shard(0),), (c,))
            along[m, c] = offset, size
    rows = []
    for coordinate in itertools.product(*varying):
        offsets, sizes = [0] * len(global_shape), list(global_shape)
        for m, p in enumerate(placements):
            if type(p) is Shard:
                offsets[p.dim], sizes[p.dim] = along[m, coordinate[m]]
        rows.append((coordinate, tuple(offsets), tuple(sizes)))
    return tuple(rows)


class MeshIndex:
    """Every rank's chunk of a DTensor, from its global shape, mesh and placements."""

    def __init__(self):
        self._signatures: dict[int, str] = {}
        self._chunk_lists: dict[tuple, list[ChunkStorageMetadata]] = {}
        self._positions: dict[int, dict[tuple, int]] = {}

    def signature(self, mesh) -> str:
        """The mesh's shape and ranks, for the structure digest."""
        if id(mesh) not in self._signatures:
            ranks = mesh.mesh.flatten().tolist()
            self._signatures[id(mesh)] = f"{tuple(mesh.mesh.shape)}:{hashlib.sha256(str(ranks).encode()).hexdigest()[:16]}"
        return self._signatures[id(mesh)]

    def chunks(self, value: DTensor) -> list[ChunkStorageMetadata]:
        """The distinct chunks of all the mesh's ranks, in row-major order of first holder;
        one list per (shape, mesh, placements), shared by every tensor that has them."""
        key = layout_key(value)
        if key not in self._chunk_lists:
            seen = {}
            for _, offsets, sizes in chunk_table(*key):  # replicas, and the empty chunk past a narrow dim, once
                if (offsets, sizes) not in seen:
                    seen[offsets, sizes] = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))
            self._chunk_lists[key] = list(seen.values())
        return self._chunk_lists[key]

    @property
    def chunk_list_count(self) -> int:
        """How many distinct chunk lists (one per shape, mesh and placements) were built."""
        return len(self._chunk_lists)

    def position(self, value: DTensor, offsets) -> int:
        """The position of the chunk at `offsets` in `chunks(value)`."""
        chunks = self.chunks(value)
        if id(chunks) not in self._positions:
            self._positions[id(chunks)] = {tuple(c.offsets): i for i, c in enumerate(chunks)}
        return self._positions[id(chunks)][tuple(offsets)]

    def not_derivable(self, items: list[WriteItem], state_dict: dict) -> str | None:
        """None when every sharded item is a plain DTensor whose chunk is the one torch's chunk
        function gives for this rank's coordinate; else why not, naming the first key."""
        for item in items:
            if item.type != WriteItemType.SHARD:
                continue
            fqn = item.index.fqn
            value = state_dict.get(fqn)
            if type(value) is not DTensor:
                return f"{fqn} is a {type(value).__name__}, not a DTensor"
            chunk = item.tensor_data.chunk
            expected = local_chunk(*layout_key(value), tuple(value.device_mesh.get_coordinate()))
            if (tuple(chunk.offsets), tuple(chunk.sizes)) != expected:
                return f"{fqn}'s chunk {tuple(chunk.offsets)}+{tuple(chunk.sizes)} is not torch's {expected}"
        return None

    @staticmethod
    def meshes_not_spanning(ranks: set[int], items: list[WriteItem], state_dict: dict) -> str | None:
        """The first key whose DTensor mesh holds other ranks than `ranks` (the save's)."""
        checked_meshes = {}
        for item in items:
            value = state_dict.get(item.index.fqn)
            if isinstance(value, DTensor):
                mesh = value.device_mesh
                if id(mesh) not in checked_meshes:
                    mesh_ranks = mesh.mesh.flatten().tolist()
                    checked_meshes[id(mesh)] = len(mesh_ranks) == len(ranks) and set(mesh_ranks) == ranks
                if not checked_meshes[id(mesh)]:
                    return item.index.fqn
        return None

    def metadata(self, items: list[WriteItem], state_dict: dict) -> Metadata:
        """The global metadata from one rank's full local plan (every rank holds the same keys)."""
        md: dict = {}
        for item in items:
            fqn = item.index.fqn
            if item.type == WriteItemType.BYTE_IO:
                md[fqn] = BytesStorageMetadata()
                continue
            td = item.tensor_data
            chunks = self.chunks(state_dict[fqn]) if item.type == WriteItemType.SHARD else [td.chunk]
            md[fqn] = TensorStorageMetadata(properties=td.properties, size=td.size, chunks=chunks)
        return Metadata(md)

"""ScalableSavePlanner: DCP's stock save format, without the coordinator's per-replica work.

Stock `DefaultSavePlanner` has every rank put every item it holds into its local plan:
a plain tensor (AdamW's `step`, an FSDP-ignored parameter) or a bytes item (the param
groups) is shipped by all N ranks, and the coordinator deduplicates N copies of each;
then `_validate_global_plan` compares every pair of chunks of every tensor (torch 2.8:
quadratic in the shard count). This planner changes exactly those two things:

* ownership, decided locally: every replicated item is assigned to one owner by a rule
  all holders compute identically from their own state dict (greedy by bytes, largest
  first, ties by key). Plain tensors and bytes are assumed to be the same keys on every
  rank; one small all-reduce of a digest of the plan's structure confirms it, and when
  ranks disagree every rank keeps everything and the coordinator falls back to stock dedup.
  For DTensors the mesh says who holds a copy: replicas along Replicate mesh dimensions.
* derived metadata: a DTensor's chunks on every rank follow from its global shape, mesh and
  placements (torch's own `_compute_local_shape_and_global_offset`, the function every rank's
  local plan came from). When every rank confirms in the same all-reduce that its plan is
  derivable that way, ranks send rank 0 an empty plan instead of their items, and rank 0
  builds the metadata from its own state dict: one chunk list per distinct (shape, mesh,
  placements), shared by every tensor that has it. Rank 0's work then grows with the
  distinct shapes times N, not with the tensors times N.
* validation in time linear in the chunks (coordinate-compressed coverage grid), with the
  same three verdicts as torch's: chunk in bounds, no overlap, full coverage; once per
  distinct chunk list.

The global plan, the metadata and the files are built by torch's own functions, so stock
`dcp.load` / `accelerator.load_state` read the checkpoint and can reshard it.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import hashlib
import heapq
import itertools
import math
from collections import ChainMap
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint.default_planner import create_default_global_save_plan
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                   TensorStorageMetadata)
from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType
from torch.distributed.tensor import DTensor, Replicate, Shard


class ScalableSavePlanner(DefaultSavePlanner):
    """Drop-in for `DefaultSavePlanner` in `dcp.save(..., planner=ScalableSavePlanner())`.

    `process_group`: the group `dcp.save` runs on (None: the default group); the agreement
    check is one all-reduce of three int64 on it. After `create_local_plan`, `mode` says
    which path the save took: "derived" (rank 0 builds the metadata alone), "owned" (ranks
    send their owned items) or "stock" (ranks disagree on the replicated keys: stock dedup).
    """

    def __init__(self, process_group=None, check_replicas: bool = True, derive_metadata: bool = True, **kwargs):
        super().__init__(**kwargs)
        self.process_group = process_group
        self.check_replicas = check_replicas
        self.derive_metadata = derive_metadata
        self.mode = "owned"

    @property
    def replicas_agree(self) -> bool:
        return self.mode != "stock"

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()
        if not (dist.is_available() and dist.is_initialized()):
            self.plan = plan
            return plan
        group_ranks = dist.get_process_group_ranks(self.process_group or dist.group.WORLD)
        self.meshes = MeshIndex(group_ranks)
        self.mode = self._agreed_path(plan)
        if self.mode == "stock":
            self.plan = plan
            return plan
        rank = dist.get_rank(self.process_group)
        self.all_items = plan.items  # on the derived path rank 0 describes every rank's chunks from these
        self.plan = dataclasses.replace(plan, items=owned_items(plan.items, lambda fqn: Placement.of(self.state_dict[fqn]),
                                                                rank, len(group_ranks)))
        # the flatten mapping is the same on every rank (in the digest): rank 0's is enough
        planner_data = plan.planner_data if rank == 0 else {}
        if self.mode == "derived":
            return SavePlan([], planner_data=planner_data)
        return dataclasses.replace(self.plan, planner_data=planner_data)

    def _agreed_path(self, plan: SavePlan) -> str:
        """One all-reduce decides for every rank: do all hold the same structure (else
        "stock"), and is every rank's plan derivable from rank 0's ("derived") or not ("owned")?"""
        if not self.check_replicas:
            return "owned"
        digest = structure_digest(plan.items, self.state_dict, getattr(self, "mappings", {}), self.meshes)
        derivable = self.derive_metadata and self.meshes.plan_is_derivable(plan.items, self.state_dict)
        agree, all_derivable = _all_ranks_agree(digest, derivable, self.process_group)
        return "stock" if not agree else "derived" if all_derivable else "owned"

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        if self.mode != "stock":
            # Items are unique by construction: no dedup, and every rank already holds its final
            # plan, so only an empty "use your own" plan is scattered (SavePlan.usable=False).
            if self.mode == "derived":
                metadata = self.derived_metadata()
            else:
                metadata = build_metadata(all_plans)
            global_plan = [SavePlan([], usable=False) for _ in all_plans]
        else:  # ranks hold different replicated keys: stock dedup decides who writes what
            global_plan, metadata = create_default_global_save_plan(self._dedup_save_plans(all_plans))
        if self.flatten_state_dict:
            metadata = dataclasses.replace(metadata, planner_data=dict(ChainMap(*[p.planner_data for p in all_plans])))
        problems = validate_chunks(metadata)
        if problems:
            raise ValueError("invalid global save plan: " + "; ".join(problems[:5]))
        self.global_plan, self.metadata = global_plan, metadata
        return global_plan, metadata

    def derived_metadata(self) -> Metadata:
        """The global metadata rank 0 builds alone on the derived path: from its own full
        local plan, every rank's chunks derived from each DTensor's shape, mesh and placements."""
        return self.meshes.metadata(self.all_items, self.state_dict)

    def chunk_position(self, fqn: str, offsets) -> int:
        """Where this rank's chunk of `fqn` sits in the metadata's chunk list on the derived
        path (0 for a plain tensor, -1 for bytes): what storage.WrittenItems sends rank 0."""
        value = self.state_dict[fqn]
        if isinstance(value, DTensor):
            return self.meshes.position(value, offsets)
        return 0 if isinstance(value, torch.Tensor) else -1

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        if not new_plan.usable:  # keep the local plan, with the storage writer's file prefix
            new_plan = dataclasses.replace(self.plan, storage_data=new_plan.storage_data, usable=True)
        self.plan = new_plan
        return new_plan


def build_metadata(plans: list[SavePlan]) -> Metadata:
    """The metadata `create_default_global_save_plan` builds, without copying every item."""
    md: dict = {}
    for plan in plans:
        for item in plan.items:
            fqn = item.index.fqn
            if item.type == WriteItemType.BYTE_IO:
                if fqn in md:
                    raise ValueError(f"{fqn} is written by two ranks")
                md[fqn] = BytesStorageMetadata()
                continue
            td = item.tensor_data
            entry = md.get(fqn)
            if entry is None:
                entry = md[fqn] = TensorStorageMetadata(properties=td.properties, size=td.size, chunks=[])
            elif item.type != WriteItemType.SHARD:
                raise ValueError(f"{fqn} is written by two ranks")
            entry.chunks.append(td.chunk)
    return Metadata(md)


# -- derived metadata --------------------------------------------------------------------

class MeshIndex:
    """Every rank's chunk of a DTensor, from its global shape, mesh and placements.

    `group_ranks`: the global ranks of the save's process group. A mesh qualifies only when
    it holds exactly those ranks, so that the chunks derived for its coordinates are the
    chunks the group's ranks write."""

    def __init__(self, group_ranks: list[int]):
        self.group_ranks = set(group_ranks)
        self._spans: dict[int, bool] = {}
        self._signatures: dict[int, str] = {}
        self._chunk_lists: dict[tuple, list[ChunkStorageMetadata]] = {}
        self._positions: dict[int, dict[tuple, int]] = {}

    def spans_group(self, mesh) -> bool:
        if id(mesh) not in self._spans:
            ranks = mesh.mesh.flatten().tolist()
            self._spans[id(mesh)] = len(ranks) == len(self.group_ranks) and set(ranks) == self.group_ranks
        return self._spans[id(mesh)]

    def signature(self, mesh) -> str:
        """The mesh's shape and ranks, for the structure digest."""
        if id(mesh) not in self._signatures:
            ranks = mesh.mesh.flatten().tolist()
            self._signatures[id(mesh)] = f"{tuple(mesh.mesh.shape)}:{hashlib.sha256(str(ranks).encode()).hexdigest()[:16]}"
        return self._signatures[id(mesh)]

    def chunks(self, value: DTensor) -> list[ChunkStorageMetadata]:
        """The distinct chunks of all the group's ranks, in row-major order of first holder;
        one list per (shape, mesh, placements), shared by every tensor that has them."""
        key = _layout_key(value)
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

    def plan_is_derivable(self, items: list[WriteItem], state_dict: dict) -> bool:
        """Whether every sharded item is a plain DTensor over the group's ranks whose chunk
        is the one torch's chunk function gives for this rank's coordinate."""
        for item in items:
            if item.type != WriteItemType.SHARD:
                continue
            value = state_dict.get(item.index.fqn)
            if type(value) is not DTensor or not self.spans_group(value.device_mesh):
                return False
            chunk = item.tensor_data.chunk
            expected = _local_chunk(*_layout_key(value), tuple(value.device_mesh.get_coordinate()))
            if (tuple(chunk.offsets), tuple(chunk.sizes)) != expected:
                return False
        return True

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


# -- ownership --------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Placement:
    """Where one DTensor's local chunk lives: all ownership needs to know about it."""

    mesh_shape: tuple[int, ...]
    coordinate: tuple[int, ...]
    placements: tuple
    global_shape: tuple[int, ...]

    @classmethod
    def of(cls, value) -> "Placement | None":
        if not isinstance(value, DTensor) or value.device_mesh.get_coordinate() is None:
            return None
        return cls(tuple(value.device_mesh.shape), tuple(value.device_mesh.get_coordinate()),
                   tuple(value.placements), tuple(value.shape))

    def replica_slot(self) -> tuple[int, int] | None:
        """(this rank's index among the holders of its chunk, number of holders), or None."""
        index, count = 0, 1
        for dim, placement in enumerate(self.placements):
            if isinstance(placement, Replicate):
                index, count = index * self.mesh_shape[dim] + self.coordinate[dim], count * self.mesh_shape[dim]
        return (index, count) if count > 1 else None

    def first_holder_of_empty_chunk(self, offsets, sizes) -> bool:
        """Ranks past the end of a dimension smaller than the shard group can hold the same
        empty chunk (same index; stock dedup keeps one). Among the coordinates that share
        this rank's Replicate coordinates (the replica rule picks among those), keep it at the
        first one, in row-major order, that holds it."""
        table = chunk_table(self.global_shape, self.mesh_shape, self.placements)
        first = next(c for c, o, s in table if (o, s) == (tuple(offsets), tuple(sizes)))
        return first == tuple(0 if isinstance(p, Replicate) else c for c, p in zip(self.coordinate, self.placements))


# -- every coordinate's chunk, from torch's chunk function ---------------------------------

def clear_chunk_caches() -> None:
    """Forget the chunk tables (the simulator times a first save, without them)."""
    chunk_table.cache_clear()
    _local_chunk.cache_clear()


def _layout_key(value: DTensor) -> tuple:
    return tuple(value.shape), tuple(value.device_mesh.shape), tuple(value.placements)


@functools.lru_cache(maxsize=4096)
def _local_chunk(global_shape, mesh_shape, placements, coordinate) -> tuple[tuple, tuple]:
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
        return tuple((c, *_local_chunk(global_shape, mesh_shape, placements, c)) for c in itertools.product(*varying))
    along = {}  # (mesh dim, coordinate) -> (offset, size) along the tensor dim it splits: a 1-D split
    for m, p in enumerate(placements):
        for c in range(mesh_shape[m]) if type(p) is Shard else ():
            (offset,), (size,) = _local_chunk((global_shape[p.dim],), (mesh_shape[m],), (Shard(0),), (c,))
            along[m, c] = offset, size
    rows = []
    for coordinate in itertools.product(*varying):
        offsets, sizes = [0] * len(global_shape), list(global_shape)
        for m, p in enumerate(placements):
            if type(p) is Shard:
                offsets[p.dim], sizes[p.dim] = along[m, coordinate[m]]
        rows.append((coordinate, tuple(offsets), tuple(sizes)))
    return tuple(rows)


def item_bytes(item: WriteItem) -> int:
    return item.tensor_storage_size() or 1  # bytes items: size unknown before serialising


def assign_owners(sizes: Iterable[tuple[str, int]], slots: int) -> dict[str, int]:
    """Greedy balance: largest item first (ties by key) to the least-loaded slot (ties by
    slot number). Deterministic, so every holder computes the same assignment."""
    ordered = sorted(sizes, key=lambda ks: (-ks[1], ks[0]))
    heap = [(0, slot) for slot in range(min(slots, len(ordered)))]  # slots past the item count stay empty
    owners = {}
    for key, size in ordered:
        load, slot = heapq.heappop(heap)
        owners[key] = slot
        heapq.heappush(heap, (load + size, slot))
    return owners


def owned_items(items: list[WriteItem], placement_of: Callable[[str], Placement | None], rank: int,
                world_size: int) -> list[WriteItem]:
    """The items this rank writes: its unique shards and the replicated items it owns.

    `placement_of(fqn)` says where a DTensor item lives (None for plain tensors and bytes,
    which every rank holds)."""
    plain_owner = assign_owners([(i.index.fqn, item_bytes(i)) for i in items if i.type != WriteItemType.SHARD],
                                world_size)
    placements = {i.index.fqn: placement_of(i.index.fqn) for i in items if i.type == WriteItemType.SHARD}
    slots = {fqn: p.replica_slot() for fqn, p in placements.items() if p is not None}
    slots = {fqn: slot for fqn, slot in slots.items() if slot is not None}
    by_count: dict[int, list[tuple[str, int]]] = {}
    for item in items:
        if item.index.fqn in slots:
            by_count.setdefault(slots[item.index.fqn][1], []).append((item.index.fqn, item_bytes(item)))
    shard_owner = {fqn: owner for count, sizes in by_count.items() for fqn, owner in assign_owners(sizes, count).items()}
    kept = []
    for item in items:
        fqn = item.index.fqn
        if item.type != WriteItemType.SHARD:
            keep = plain_owner[fqn] == rank
        else:
            keep = fqn not in slots or shard_owner[fqn] == slots[fqn][0]
            if keep and placements.get(fqn) is not None and math.prod(item.tensor_data.chunk.sizes) == 0:
                keep = placements[fqn].first_holder_of_empty_chunk(item.index.offset, item.tensor_data.chunk.sizes)
        if keep:
            kept.append(item)
    return kept


def structure_digest(items: list[WriteItem], state_dict: dict, mappings: dict | None = None,
                     meshes: "MeshIndex | None" = None) -> int:
    """A 63-bit digest of what the plan holds (keys, types, global sizes, dtypes, placements
    and meshes, and the flatten mapping), not of the values."""
    rows = [f"mapping|{key}|{path}" for key, path in (mappings or {}).items()]
    for item in items:
        td = item.tensor_data
        value = state_dict.get(item.index.fqn)
        placement = ""
        if isinstance(value, DTensor):
            placement = f"{value.placements}|{meshes.signature(value.device_mesh) if meshes else ''}"
        rows.append(f"{item.index.fqn}|{item.type.name}|{None if td is None else tuple(td.size)}|"
                    f"{None if td is None else td.properties.dtype}|{placement}")
    digest = hashlib.sha256("\n".join(sorted(rows)).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def _all_ranks_agree(value: int, derivable: bool, group) -> tuple[bool, bool]:
    """One all-reduce: MIN of (v, -v, derivable) gives (min v, -max v, all derivable)."""
    both = torch.tensor([value, -value, int(derivable)], dtype=torch.int64)
    dist.all_reduce(both, op=dist.ReduceOp.MIN, group=group)
    return int(both[0]) == -int(both[1]), int(both[2]) == 1


# -- linear validation -------------------------------------------------------------------

MAX_GRID_CELLS_PER_CHUNK = 64  # beyond this the chunks do not form a grid: check pairs


def validate_chunks(metadata: Metadata) -> list[str]:
    """torch's three checks on every tensor (bounds, overlap, coverage); [] when valid.
    A chunk list shared by several tensors of one size is checked once."""
    problems, checked = [], set()
    for key, md in metadata.state_dict_metadata.items():
        if isinstance(md, BytesStorageMetadata) or len(md.size) == 0:
            continue
        if (id(md.chunks), tuple(md.size)) in checked:
            continue
        checked.add((id(md.chunks), tuple(md.size)))
        problems += _validate_tensor(key, tuple(md.size), [(tuple(c.offsets), tuple(c.sizes)) for c in md.chunks])
    return problems


def _validate_tensor(key: str, size: tuple[int, ...], chunks: list[tuple[tuple, tuple]]) -> list[str]:
    problems = []
    for offsets, sizes in chunks:
        if any(o < 0 or s < 0 or o + s > n for o, s, n in zip(offsets, sizes, size)):
            problems.append(f"{key}: chunk {offsets}+{sizes} out of bounds of {size}")
    volume = sum(math.prod(s) for _, s in chunks)
    if volume != math.prod(size):
        problems.append(f"{key}: chunks cover {volume} elements of {math.prod(size)}")
    if not problems and _overlap(chunks):
        problems.append(f"{key}: overlapping chunks")
    return problems


def _overlap(chunks: list[tuple[tuple, tuple]]) -> bool:
    """Whether two non-empty chunks share an element, in time linear in the chunks when
    they form a grid (every FSDP/HSDP layout): count coverage on the grid of their edges."""
    boxes = [(o, s) for o, s in chunks if all(s)]
    if len(boxes) < 2:
        return False
    split = _single_split_dim(boxes)
    if split is not None:  # FSDP/HSDP: chunks are slabs along one dimension; sort and compare neighbours
        spans = sorted((o[split], o[split] + s[split]) for o, s in boxes)
        return any(start < previous_end for (_, previous_end), (start, _) in zip(spans, spans[1:]))
    edges = [sorted({o[d] for o, _ in boxes} | {o[d] + s[d] for o, s in boxes}) for d in range(len(boxes[0][0]))]
    cells = math.prod(len(e) - 1 for e in edges)
    if cells > MAX_GRID_CELLS_PER_CHUNK * len(boxes):
        return _overlap_pairwise(boxes)
    grid = torch.zeros([len(e) - 1 for e in edges], dtype=torch.int32)
    for offsets, sizes in boxes:
        index = tuple(slice(bisect.bisect_left(e, o), bisect.bisect_left(e, o + s))
                      for e, o, s in zip(edges, offsets, sizes))
        grid[index] += 1
    return bool((grid > 1).any())


def _single_split_dim(boxes) -> int | None:
    """The one dimension the chunks differ in, if all agree on every other (offset and size)."""
    first_offsets, first_sizes = boxes[0]
    differing = {d for o, s in boxes for d in range(len(o)) if o[d] != first_offsets[d] or s[d] != first_sizes[d]}
    return differing.pop() if len(differing) == 1 else (0 if not differing else None)


def _overlap_pairwise(boxes) -> bool:
    for i, (o0, s0) in enumerate(boxes):
        for o1, s1 in boxes[i + 1:]:
            if all(a < b + t and b < a + u for a, u, b, t in zip(o0, s0, o1, s1)):
                return True
    return False

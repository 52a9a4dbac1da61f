"""Who writes what: every item of a save written by exactly one rank.

* DTensor chunks (`owned_shards`, every rank locally): by the rank that holds them; among
  replicas (Replicate mesh dims) by a rule every holder computes identically (`assign_owners`,
  balanced by bytes, largest first; or the lowest rank, as stock's `dedup_save_to_lowest_rank`);
  an empty chunk several ranks hold past the end of a narrow dimension, by the first of them;
* plain tensors and bytes items, the same keys on every rank (`assign_plain_items`, rank 0): one
  writer each, balanced by bytes, or rank 0.

Used by the planner (planner.py) and by `check` (check/save_phases.py).
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from collections.abc import Callable, Iterable

from torch.distributed.checkpoint.planner import WriteItem, WriteItemType
from torch.distributed.tensor import DTensor, Replicate

from .chunks import chunk_table


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
        """(this rank's index among the holders of its chunk, number of holders), or None.
        Index 0 holds all Replicate coordinates at 0: the lowest rank of a row-major mesh."""
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


def owned_shards(items: list[WriteItem], placement_of: Callable[[str], Placement | None],
                 lowest_rank: bool = False) -> list[WriteItem]:
    """The DTensor chunks this rank writes: its unique shards, and the replicated ones it owns.

    Replicas (Replicate mesh dims) are assigned by bytes, largest first, over the replica
    slots, every holder computing the same assignment; with `lowest_rank` (stock's
    dedup_save_to_lowest_rank) slot 0 keeps them all."""
    placements = {i.index.fqn: placement_of(i.index.fqn) for i in items if i.type == WriteItemType.SHARD}
    slots = {fqn: p.replica_slot() for fqn, p in placements.items() if p is not None}
    slots = {fqn: slot for fqn, slot in slots.items() if slot is not None}
    by_count: dict[int, list[tuple[str, int]]] = {}
    for item in items:
        if item.index.fqn in slots:
            by_count.setdefault(slots[item.index.fqn][1], []).append((item.index.fqn, item_bytes(item)))
    shard_owner = {} if lowest_rank else \
        {fqn: owner for count, sizes in by_count.items() for fqn, owner in assign_owners(sizes, count).items()}
    kept = []
    for item in items:
        fqn = item.index.fqn
        if item.type != WriteItemType.SHARD:
            continue
        keep = fqn not in slots or shard_owner.get(fqn, 0) == slots[fqn][0]
        if keep and placements.get(fqn) is not None and math.prod(item.tensor_data.chunk.sizes) == 0:
            keep = placements[fqn].first_holder_of_empty_chunk(item.index.offset, item.tensor_data.chunk.sizes)
        if keep:
            kept.append(item)
    return kept


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


def assign_plain_items(sizes: dict[str, int], ranks: int, lowest_rank: bool) -> dict[str, int]:
    """One writer for each plain item every rank holds: rank 0 (stock's
    dedup_save_to_lowest_rank), or balanced by bytes, largest first (ties by key)."""
    if lowest_rank:
        return dict.fromkeys(sizes, 0)
    return assign_owners(sizes.items(), ranks)

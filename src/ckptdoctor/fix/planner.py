"""ScalableSavePlanner: DCP's stock save format, without the coordinator's per-rank work.

Stock `DefaultSavePlanner` has every rank put every item it holds into its local plan; rank 0
receives N plans, deduplicates the N copies of each replicated item (AdamW's `step`, an
FSDP-ignored parameter, the param groups), checks every pair of chunks of every tensor
(torch 2.8: quadratic in the shard count) and scatters one plan back to each rank. With FSDP
over all N ranks that is N x tensors objects through rank 0. This planner keeps DCP's
protocol, files and metadata, and changes what travels:

* the handshake: each rank sends rank 0 a few numbers instead of its items: its global rank,
  a digest of what its plan holds (keys, types, sizes, dtypes, placements, meshes, the
  flatten mapping; not the values) and whether its chunks are the ones torch's chunk function
  gives for its mesh coordinate. No collective of its own: everything rides DCP's own
  gather and scatter, so a rank that fails in planning fails the save for every rank, as
  stock does, and `dcp.save(process_group=...)` needs nothing more;
* derived metadata: when the handshakes agree, rank 0 builds the metadata from its own
  state dict: a DTensor's chunks on every rank follow from its global shape, mesh and
  placements (torch's `_compute_local_shape_and_global_offset`, the function every rank's
  local plan came from), one chunk list per distinct (shape, mesh, placements);
* ownership: every item is written by exactly one rank. DTensor chunks: by their holder, and
  among replicas (Replicate mesh dims) by a rule every holder computes identically; plain
  tensors and bytes items (the same keys on every rank, the digest says so): by the rank
  rank 0 assigns them to in the scattered plan (balanced by bytes, or the lowest rank with
  `dedup_save_to_lowest_rank=True`, as stock);
* validation in time linear in the chunks, with torch's three verdicts (in bounds, no
  overlap, full coverage), once per distinct chunk list; and at the finish step a check
  that what the ranks wrote is exactly what the metadata lists (`coverage_problems`).

The "owned" path, at stock's cost: ranks send the items they own and rank 0 builds the
metadata from them; `derive_metadata=False` always takes it. Otherwise a rank that sees by
itself that rank 0 could not derive its chunks (a ShardedTensor, a chunk torch's function does
not predict, a DTensor on a mesh that is not the whole world, e.g. a sub-mesh) sends its owned
items with its handshake; when every rank did, the save takes the owned path by itself, with
one warning on rank 0, so the planner used alone saves what stock saves. What no rank can see
alone (ranks holding different keys, or only some ranks in doubt) fails the save with
`NotDerivable` on every rank before anything is written; `ScalableCheckpointing` retries such
a save on the owned path.

Optional: `verify_replicas=True` (or a predicate on keys) adds a CRC-32 of every replicated
tensor to the handshake, and the save fails, naming the keys, when replicas differ. Stock
keeps one rank's copy without looking; so does this planner when the check is off.

The global plan, metadata and files are torch's formats, so stock `dcp.load` /
`accelerator.load_state` read the checkpoint and can reshard it.
"""

from __future__ import annotations

import bisect
import collections
import copyreg
import dataclasses
import functools
import hashlib
import heapq
import itertools
import logging
import math
import zlib
from collections.abc import Callable, Iterable

import torch
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                   TensorStorageMetadata)
from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType
from torch.distributed.tensor import DTensor, Replicate, Shard

from ..errors import CkptDoctorError
from .compat import check_torch

log = logging.getLogger(__name__)


class NotDerivable(CkptDoctorError):
    """Rank 0 cannot derive the metadata of this save from its own state dict."""


class ReplicasDiffer(CkptDoctorError):
    """Replicas of a replicated tensor hold different values (only with verify_replicas)."""


class IncompleteWrite(CkptDoctorError):
    """What the ranks wrote is not exactly what the metadata lists."""


@dataclasses.dataclass(frozen=True)
class Handshake:
    """What a rank sends rank 0 in the plan gather (as the plan's planner_data)."""

    global_rank: int
    digest: int
    not_derivable: str | None                  # None: every chunk is the one torch's function gives
    checksums: dict | None = None              # (fqn, offsets) -> CRC-32, with verify_replicas
    mappings: dict | None = None               # the flatten mapping, on the owned path only
    sent_owned: bool = False                   # the plan carries this rank's owned items


@dataclasses.dataclass(frozen=True)
class Assignment:
    """What rank 0 scatters back to each rank: the path taken and what the rank writes: on the
    derived path its plain items (its DTensor chunks it knows), on the owned path every item."""

    mode: str                                  # "derived" or "owned"
    plain_keys: tuple[str, ...] = ()
    items: tuple[WriteItem, ...] | None = None


class ScalableSavePlanner(DefaultSavePlanner):
    """Drop-in for `DefaultSavePlanner` in `dcp.save(..., planner=ScalableSavePlanner())`.

    Takes `DefaultSavePlanner`'s arguments. `enable_plan_caching` is accepted and has no
    effect: ranks already send a handshake instead of their plans, which is what caching
    saves, and every save builds the same checkpoint. After a save, `mode` says which path
    it took ("derived" or "owned") on every rank, and `plan` holds what this rank wrote.
    """

    def __init__(self, *args, derive_metadata: bool = True,
                 verify_replicas: bool | Callable[[str], bool] = False, **kwargs):
        super().__init__(*args, **kwargs)
        self._enable_plan_caching = False  # see the class docstring
        self.derive_metadata = derive_metadata
        self.verify_replicas = verify_replicas
        self.mode = "derived" if derive_metadata else "owned"

    # -- every rank: local plan ------------------------------------------------------------
    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator: bool = False) -> None:
        check_torch("ScalableSavePlanner")
        super().set_up_planner(state_dict, storage_meta, is_coordinator)
        self.meshes = MeshIndex()

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()  # torch's own local plan: every item this rank holds
        self.local_items = plan.items
        self.owned_shards = owned_shards(plan.items, lambda fqn: Placement.of(self.state_dict[fqn]),
                                         lowest_rank=self.dedup_save_to_lowest_rank)
        doubt = self.meshes.not_derivable(plan.items, self.state_dict) or \
            self.meshes.not_whole_world(plan.items, self.state_dict)
        send_owned = not self.derive_metadata or doubt is not None
        handshake = Handshake(
            global_rank=_global_rank(),
            digest=structure_digest(plan.items, self.state_dict, self.mappings, self.meshes),
            not_derivable=doubt,
            checksums=replica_checksums(plan.items, self.state_dict, self.verify_replicas),
            mappings=self.mappings if send_owned else None, sent_owned=send_owned)
        if send_owned:  # this rank's shards and every plain item it holds
            plain = [i for i in plan.items if i.type != WriteItemType.SHARD]
            self.plan = SavePlan(self.owned_shards + plain, planner_data=handshake)
        else:
            self.plan = SavePlan([], planner_data=handshake)
        return self.plan

    # -- rank 0: global plan ---------------------------------------------------------------
    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        handshakes = [p.planner_data for p in all_plans]
        if not all(isinstance(h, Handshake) for h in handshakes):
            raise NotDerivable("every rank of this save must use ScalableSavePlanner (a rank sent a stock plan)")
        check_replicas(handshakes)
        owned = all(h.sent_owned for h in handshakes)
        if owned and self.derive_metadata:
            log.warning("ScalableSavePlanner: rank 0 cannot derive this save's metadata (%s); every rank sent "
                        "its owned items instead, so the save takes the owned path, at stock's cost",
                        next((h.not_derivable for h in handshakes if h.not_derivable), "?"))
        if not owned:
            self.check_handshakes(handshakes)
            metadata, mappings = self.derived_metadata(), self.mappings
            plain = [i for i in self.local_items if i.type != WriteItemType.SHARD]
            owners = assign_plain_items({i.index.fqn: item_bytes(i) for i in plain}, len(all_plans),
                                        self.dedup_save_to_lowest_rank)
            by_rank: list[list[str]] = [[] for _ in all_plans]
            for fqn, rank in owners.items():
                by_rank[rank].append(fqn)
            global_plan = [SavePlan([], planner_data=Assignment("derived", plain_keys=tuple(keys))) for keys in by_rank]
        else:  # ranks sent what they own; plain items and chunks several ranks hold: stock's dedup picks one
            deduped = self._dedup_save_plans(all_plans)  # DefaultSavePlanner's own, with its lowest-rank option
            metadata = build_metadata(deduped)
            mappings = dict(collections.ChainMap(*[h.mappings for h in handshakes if h.mappings]))
            global_plan = [SavePlan([], planner_data=Assignment("owned", items=tuple(p.items))) for p in deduped]
        if self.flatten_state_dict:
            metadata = dataclasses.replace(metadata, planner_data=mappings)
        problems = validate_chunks(metadata)
        if problems:
            raise ValueError("invalid global save plan: " + "; ".join(problems[:5]))
        self.global_plan, self.metadata = global_plan, checked(metadata)
        return global_plan, self.metadata

    def check_handshakes(self, handshakes: list[Handshake]) -> None:
        """Raise NotDerivable unless rank 0's own state dict describes every rank's chunks."""
        mine = handshakes[0]
        for rank, h in enumerate(handshakes):
            if h.not_derivable is not None:
                raise NotDerivable(f"rank {rank}: {h.not_derivable}")
            if h.digest != mine.digest:
                raise NotDerivable(f"rank {rank} holds a different state dict structure than rank 0 (keys, sizes, "
                                   f"dtypes, placements or meshes differ)")
        ranks = {h.global_rank for h in handshakes}
        if len(ranks) != len(handshakes):
            raise NotDerivable("two ranks of this save report the same global rank")
        outside = self.meshes.meshes_not_spanning(ranks, self.local_items, self.state_dict)
        if outside:
            raise NotDerivable(f"{outside} is on a mesh whose ranks are not exactly the ranks of this save")

    def derived_metadata(self) -> Metadata:
        """The global metadata rank 0 builds alone: from its own full local plan, every rank's
        chunks derived from each DTensor's shape, mesh and placements."""
        return self.meshes.metadata(self.local_items, self.state_dict)

    # -- every rank: final plan ------------------------------------------------------------
    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        assignment = new_plan.planner_data
        if not isinstance(assignment, Assignment):
            raise NotDerivable("the plan rank 0 sent is not ScalableSavePlanner's (another planner on rank 0?)")
        self.mode = assignment.mode
        if assignment.items is not None:
            items = list(assignment.items)
        else:
            mine = set(assignment.plain_keys)
            plain = [i for i in self.local_items if i.type != WriteItemType.SHARD and i.index.fqn in mine]
            if len(plain) != len(mine):
                raise NotDerivable(f"rank 0 assigned this rank {len(mine) - len(plain)} plain item(s) it does not hold")
            items = self.owned_shards + plain
        self.plan = SavePlan(items, storage_data=new_plan.storage_data, usable=True)
        return self.plan

    def chunk_position(self, fqn: str, offsets) -> int:
        """Where this rank's chunk of `fqn` sits in the metadata's chunk list on the derived
        path (0 for a plain tensor, -1 for bytes): what storage.WrittenItems sends rank 0."""
        value = self.state_dict[fqn]
        if isinstance(value, DTensor):
            return self.meshes.position(value, offsets)
        return 0 if isinstance(value, torch.Tensor) else -1


def _global_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


# -- rank 0: the owned path and plain items ---------------------------------------------------

def build_metadata(plans: list[SavePlan]) -> Metadata:
    """The metadata `create_default_global_save_plan` builds from deduplicated plans, without
    copying every item; a key two ranks write whole is an error."""
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


def assign_plain_items(sizes: dict[str, int], ranks: int, lowest_rank: bool) -> dict[str, int]:
    """One writer for each plain item every rank holds: rank 0 (stock's
    dedup_save_to_lowest_rank), or balanced by bytes, largest first (ties by key)."""
    if lowest_rank:
        return dict.fromkeys(sizes, 0)
    return assign_owners(sizes.items(), ranks)


# -- rank 0: replica values -------------------------------------------------------------------

def replica_checksums(items: list[WriteItem], state_dict: dict, which) -> dict | None:
    """CRC-32 of this rank's copy of every replicated tensor `which` selects (None: off)."""
    if not which:
        return None
    selected = which if callable(which) else (lambda fqn: True)
    sums = {}
    for item in items:
        fqn = item.index.fqn
        value = state_dict.get(fqn)
        if item.type == WriteItemType.BYTE_IO or not selected(fqn):
            continue
        if isinstance(value, DTensor):
            placement = Placement.of(value)
            if placement is None or placement.replica_slot() is None:
                continue  # a unique shard: nothing to compare it with
            value = value.to_local()
        if isinstance(value, torch.Tensor) and value.device.type != "meta":
            data = value.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()
            sums[fqn, tuple(item.index.offset or ())] = zlib.crc32(data)
    return sums


def check_replicas(handshakes: list[Handshake]) -> None:
    """Raise ReplicasDiffer naming the keys whose replicas hold different values."""
    seen: dict[tuple, dict[int, list[int]]] = {}
    for rank, h in enumerate(handshakes):
        for key, crc in (h.checksums or {}).items():
            seen.setdefault(key, {}).setdefault(crc, []).append(rank)
    differing = sorted(key for key, crcs in seen.items() if len(crcs) > 1)
    if differing:
        detail = "; ".join(f"{fqn}: ranks {' vs '.join(','.join(map(str, r)) for r in seen[fqn, off].values())}"
                           for fqn, off in differing[:5])
        raise ReplicasDiffer(f"{len(differing)} replicated tensor(s) differ across ranks ({detail}); a checkpoint "
                             f"would keep one rank's copy. Synchronise them (e.g. average their gradients) first")


# -- the finish step: what was written is what is listed ---------------------------------------

def coverage_problems(metadata: Metadata, written: Iterable[tuple[str, tuple]]) -> list[str]:
    """Every listed (key, chunk offsets) written exactly once and nothing else; [] when so.
    `written`: (fqn, offsets) per write result, offsets () for bytes items."""
    listed = {}
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, BytesStorageMetadata):
            listed[fqn, ()] = 0
        else:
            for chunk in md.chunks:
                listed[fqn, tuple(chunk.offsets)] = 0
    extra = []
    for key in written:
        if key in listed:
            listed[key] += 1
        else:
            extra.append(key)
    problems = [f"{fqn}@{off}: written {n} times" for (fqn, off), n in listed.items() if n != 1]
    problems += [f"{fqn}@{off}: written but not listed" for fqn, off in extra]
    return problems


class CheckedMetadata(Metadata):
    """The metadata this planner returns. When a storage writer fills in `storage_data` (as
    stock `FileSystemWriter.finish` does on rank 0, just before it writes the file), the keys
    are checked against the chunks listed: a gap or a duplicate fails the save there, before
    `.metadata` exists. It pickles as torch's own `Metadata`, so the file needs no ckptdoctor."""

    def __setattr__(self, name, value):
        if name == "storage_data" and isinstance(value, dict):
            problems = coverage_problems(self, ((k.fqn, tuple(k.offset or ())) for k in value))
            if problems:
                raise IncompleteWrite(f"the ranks' writes do not match the metadata ({len(problems)} problem(s): "
                                      f"{'; '.join(problems[:5])}); nothing was published")
        super().__setattr__(name, value)

    def __reduce_ex__(self, protocol):
        state = {k: v for k, v in self.__dict__.items() if not k.startswith("_")}
        if self.__dict__.get("_written"):  # the file exists: what dcp.save broadcasts to every rank next
            state = slim(state)
        return copyreg._reconstructor, (Metadata, object, None), state


def slim(state: dict) -> dict:
    """Metadata state without chunk lists and storage index: keys, sizes, dtypes and mapping.
    What `dcp.save` returns on every rank once `ScalableFileSystemWriter` wrote the file, so
    that no rank unpickles the whole index (O(N) chunks per tensor at FSDP over N ranks)."""
    tensors = {key: md if isinstance(md, BytesStorageMetadata) else
               TensorStorageMetadata(properties=md.properties, size=md.size, chunks=[])
               for key, md in state["state_dict_metadata"].items()}
    return state | {"state_dict_metadata": tensors, "storage_data": None}


def checked(metadata: Metadata) -> CheckedMetadata:
    out = CheckedMetadata.__new__(CheckedMetadata)
    out.__dict__.update(metadata.__dict__)
    return out


# -- derived metadata --------------------------------------------------------------------

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
            expected = _local_chunk(*_layout_key(value), tuple(value.device_mesh.get_coordinate()))
            if (tuple(chunk.offsets), tuple(chunk.sizes)) != expected:
                return f"{fqn}'s chunk {tuple(chunk.offsets)}+{tuple(chunk.sizes)} is not torch's {expected}"
        return None

    def not_whole_world(self, items: list[WriteItem], state_dict: dict) -> str | None:
        """Why rank 0 could not derive a DTensor on a mesh other than the whole default group
        (e.g. a sub-mesh), as this rank sees it; None when every mesh is the whole world."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return None
        outside = self.meshes_not_spanning(set(range(dist.get_world_size())), items, state_dict)
        return None if outside is None else f"{outside} is on a mesh that is not the whole world"

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


# -- ownership of DTensor chunks (every rank, locally) ------------------------------------------

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


# -- linear validation -------------------------------------------------------------------

MAX_GRID_CELLS_PER_CHUNK = 64  # beyond this the chunks do not form a grid: check pairs


def validate_chunks(metadata: Metadata) -> list[str]:
    """torch's three checks on every tensor (bounds, overlap, coverage); [] when valid.
    A chunk list shared by several tensors of one size is checked once."""
    problems, checked_lists = [], set()
    for key, md in metadata.state_dict_metadata.items():
        if isinstance(md, BytesStorageMetadata) or len(md.size) == 0:
            continue
        if (id(md.chunks), tuple(md.size)) in checked_lists:
            continue
        checked_lists.add((id(md.chunks), tuple(md.size)))
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
    """Whether two chunks overlap as torch's box test says: two non-empty chunks that share an
    element, found in time linear in the chunks when they form a grid (every FSDP/HSDP layout:
    count coverage on the grid of their edges); or an empty chunk that lies strictly inside a
    non-empty one (torch's test has no case for size 0; FSDP's empty chunks sit at a dim's end,
    which never counts)."""
    boxes = [(o, s) for o, s in chunks if all(s)]
    empties = {(o, s) for o, s in chunks if not all(s)}  # FSDP's are all alike: checked once
    if any(_overlap_pairwise([empty, box]) for empty in empties for box in boxes):
        return True
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

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
metadata from them; `derive_metadata=False` always takes it. Which path a save takes is agreed
before any rank plans, so that the planner used alone saves whatever stock saves:

* the agreement: each rank puts (its global rank, its digest, why rank 0 could not derive its
  chunks or None: a ShardedTensor, a chunk torch's function does not give) into one all-gather of
  small objects on the group DCP is about to gather the plans on (plan_group.py: the caller
  passes nothing, and no other group is ever used). Every rank then decides alike: derived when every rank
  holds rank 0's structure, nobody is in doubt and every DTensor's mesh is exactly the save's
  ranks; otherwise owned (ranks holding different keys, as pipeline stages do; a DTensor on a
  sub-mesh; a ShardedTensor), with one warning on rank 0 naming the first reason. N x ~60 bytes
  to every rank, one collective (two: object sizes, then the objects), whatever the model;
* a rank whose local planning raised still takes part (with its failure flagged), then raises:
  DCP's own gather carries its exception to every rank, as stock's does; nothing waits for a
  deadline. A rank that died leaves the others in this all-gather for the group's timeout, as it
  would in DCP's own gather (`ScalableCheckpointing`'s heartbeat ends that wait);
* where DCP exchanges no plans (one process, `no_dist=True`) there is nobody to agree with: the
  rank's own view decides.

The handshake checks stay as a safety net: on the derived path rank 0 still refuses, with
`NotDerivable` on every rank before anything is written, a rank whose digest or view differs.

Optional: `verify_replicas=True` (or a predicate on keys) adds a CRC-32 of every replicated
tensor to the handshake, and the save fails, naming the keys, when replicas differ. Stock
keeps one rank's copy without looking; so does this planner when the check is off.

The pieces live beside this module: every rank's chunk (chunks.py), who writes what
(ownership.py), the linear validation (validation.py); this module is the protocol.

The global plan, metadata and files are torch's formats, so stock `dcp.load` /
`accelerator.load_state` read the checkpoint and can reshard it.
"""

from __future__ import annotations

import collections
import copyreg
import dataclasses
import hashlib
import logging
import zlib
from collections.abc import Callable, Iterable

import torch
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, Metadata,
                                                   TensorStorageMetadata)
from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType
from torch.distributed.tensor import DTensor

from ..errors import CkptDoctorError
from ..ranks import format_ranks
from .chunks import MeshIndex
from .compat import check_torch
from .ownership import Placement, assign_plain_items, item_bytes, owned_shards
from .plan_group import plan_group
from .validation import validate_chunks

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
        failure, digest, doubt = None, 0, None
        try:
            plan = super().create_local_plan()  # torch's own local plan: every item this rank holds
            self.local_items = plan.items
            self.owned_shards = owned_shards(plan.items, lambda fqn: Placement.of(self.state_dict[fqn]),
                                             lowest_rank=self.dedup_save_to_lowest_rank)
            digest = structure_digest(plan.items, self.state_dict, self.mappings, self.meshes)
            doubt = self.meshes.not_derivable(plan.items, self.state_dict)
        except BaseException as error:  # still agree (below), then fail: DCP's gather carries it to every rank
            failure = error
        if self.derive_metadata:
            doubt = self.agree(View(_global_rank(), digest, doubt, failure is not None))
        if failure is not None:
            raise failure
        send_owned = not self.derive_metadata or doubt is not None
        handshake = Handshake(
            global_rank=_global_rank(),
            digest=digest,
            not_derivable=doubt,
            checksums=replica_checksums(plan.items, self.state_dict, self.verify_replicas),
            mappings=self.mappings if send_owned else None, sent_owned=send_owned)
        if send_owned:  # this rank's shards and every plain item it holds
            plain = [i for i in plan.items if i.type != WriteItemType.SHARD]
            self.plan = SavePlan(self.owned_shards + plain, planner_data=handshake)
        else:
            self.plan = SavePlan([], planner_data=handshake)
        return self.plan

    def agree(self, mine: "View") -> str | None:
        """Every rank, before planning (module docstring, "the agreement"): why this save takes
        the owned path, the same answer on every rank, or None for the derived path."""
        views = all_views(mine)
        if views is None:  # one process, no group: its own view decides
            return mine.doubt
        if any(v.failed for v in views):
            return "a rank failed in planning"  # it raises; DCP's gather fails the save for every rank
        for rank, view in enumerate(views):
            if view.doubt is not None:
                return f"rank {rank}: {view.doubt}"
        differ = [rank for rank, v in enumerate(views) if v.digest != views[0].digest]
        if differ:
            return (f"rank(s) {format_ranks(differ)} hold a different state dict structure than rank 0 (keys, sizes, "
                    f"dtypes, placements or meshes differ)")
        outside = self.meshes.meshes_not_spanning({v.global_rank for v in views}, self.local_items, self.state_dict)
        if outside is not None:
            return f"{outside} is on a mesh whose ranks are not exactly the ranks of this save"
        return None

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


@dataclasses.dataclass(frozen=True)
class View:
    """What each rank puts into the agreement: a few numbers and, when in doubt, why."""

    global_rank: int
    digest: int
    doubt: str | None
    failed: bool = False


def all_views(mine: View) -> list[View] | None:
    """Every rank's view, in the plan group's rank order, through one all-gather of objects (the
    object collectives DCP itself uses, so on the device its group needs); None where DCP
    exchanges no plans."""
    import torch.distributed as dist

    where = plan_group()
    if where is None:
        return None
    views = [None] * dist.get_world_size(where.group)
    dist.all_gather_object(views, mine, group=where.group)
    return views


def _global_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


# -- rank 0: the owned path ------------------------------------------------------------------------

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

"""ScalableLoadPlanner: DCP's stock load, without rank 0 relaying every rank's read plan.

A stock `dcp.load` has every rank build its read plan (`DefaultLoadPlanner.create_local_plan`:
for every tensor, every saved chunk is tested against the rank's own chunk) and send it to
rank 0 in the plan gather; rank 0 unpickles all N plans, returns them unchanged
(`create_default_global_load_plan` is the identity, as are `FileSystemReader`'s plan steps)
and pickles them back in the scatter. This planner changes two things and nothing else:

* the exchange: a rank keeps its read plan and sends rank 0 a marker; rank 0 returns markers;
  at `finish_plan` each rank reads with its own plan. The result is the plan stock would have
  scattered back (the identity), without N plans through rank 0;
* the local plan: the reads for a tensor depend only on its saved chunk list and on the rank's
  own chunk of it (global shape, mesh, placements, coordinate). When tensors share a chunk list
  object (as in a checkpoint read through its index, `index.py`), torch's own function is asked
  once per (chunk list, local chunk) and its answer reused, renamed, for every tensor of that
  kind, instead of testing N saved chunks for each of thousands of tensors.

Same read items as stock, item for item (tests compare them). Keys the checkpoint lacks, size
mismatches and anything unusual (ShardedTensor, a pre-2.4 checkpoint's keys) go through stock's
own code, with stock's errors. Requires a storage reader whose plan steps are the identity
(`FileSystemReader`, `ScalableFileSystemReader`), and the same planner on every rank.
"""

from __future__ import annotations

import dataclasses

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem
from torch.distributed.tensor import DTensor

from ..errors import CkptDoctorError
from .compat import check_torch

_TEMPLATE = "\x00ckptdoctor-template"  # the key read items are built for before they are renamed


class MixedLoadPlanners(CkptDoctorError):
    """Ranks of one dcp.load use different planners."""


@dataclasses.dataclass(frozen=True)
class KeepYourPlan:
    """What travels instead of a read plan, both ways: how many items the rank will read."""

    items: int


class ScalableLoadPlanner(DefaultLoadPlanner):
    """Drop-in for `DefaultLoadPlanner` in `dcp.load(..., planner=ScalableLoadPlanner())`; takes
    its arguments. After a load, `plan` holds what this rank read."""

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        check_torch("ScalableLoadPlanner")
        super().set_up_planner(state_dict, metadata, is_coordinator)

    def create_local_plan(self) -> LoadPlan:
        checkpoint_keys = self.metadata.state_dict_metadata.keys()
        if self.flatten_state_dict and not checkpoint_keys <= self.state_dict.keys():
            self.plan = super().create_local_plan()  # stock's handling of pre-2.4 key formats
        else:
            self.plan = LoadPlan(read_items(self.state_dict, self.metadata, strict=not self.allow_partial_load))
        return LoadPlan([], planner_data=KeepYourPlan(len(self.plan.items)))

    def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
        if not all(isinstance(p.planner_data, KeepYourPlan) for p in global_plan):
            raise MixedLoadPlanners("every rank of this load must use ScalableLoadPlanner (a rank sent a stock plan)")
        return global_plan  # the identity, as stock's: each rank keeps its own plan

    def finish_plan(self, new_plan: LoadPlan) -> LoadPlan:
        if not isinstance(new_plan.planner_data, KeepYourPlan):
            raise MixedLoadPlanners("the plan rank 0 sent is not ScalableLoadPlanner's (another planner on rank 0?)")
        return self.plan


def read_items(state_dict: dict, metadata, strict: bool = True) -> list[ReadItem]:
    """`create_default_local_load_plan`'s read items, each kind of tensor planned once; anything
    else (a missing key, bytes, other tensor types) by that function itself, key by key."""
    from torch.distributed.checkpoint.default_planner import create_default_local_load_plan
    from torch.distributed.checkpoint.planner_helpers import _create_read_items

    templates: dict[tuple, list[ReadItem]] = {}
    requests: list[ReadItem] = []
    for fqn, obj in state_dict.items():
        md = metadata.state_dict_metadata.get(fqn)
        kind = None if md is None else _kind(md, obj)
        if kind is None:
            requests += create_default_local_load_plan({fqn: obj}, metadata, strict).items
            continue
        if md.size != obj.size():  # stock's check, stock's words
            raise ValueError(f"Size mismatch between saved {md.size} and current: {obj.size()} for {fqn}")
        if kind not in templates:
            templates[kind] = _create_read_items(_TEMPLATE, md, obj)
        requests += [_renamed(item, fqn) for item in templates[kind]]
    return requests


def _kind(md, obj) -> tuple | None:
    """What a tensor's read items depend on besides its name; None: plan it on its own."""
    if not isinstance(md, TensorStorageMetadata):
        return None
    if type(obj) is DTensor:
        mesh = obj.device_mesh
        coordinate = mesh.get_coordinate()
        if coordinate is None:
            return None
        return id(md.chunks), tuple(md.size), tuple(mesh.shape), tuple(coordinate), tuple(obj.placements)
    if type(obj) in (torch.Tensor, torch.nn.Parameter):
        return id(md.chunks), tuple(md.size), tuple(obj.size())
    return None


def _renamed(item: ReadItem, fqn: str) -> ReadItem:
    return dataclasses.replace(item, dest_index=dataclasses.replace(item.dest_index, fqn=fqn),
                               storage_index=dataclasses.replace(item.storage_index, fqn=fqn))

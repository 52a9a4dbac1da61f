"""What an async save costs each rank at N ranks: the host copy training waits for
(`check --async`; the save itself: fix/background.py, the copy: fix/host_copy.py).

With `async_save=True`, `save_state` returns once every rank has copied its state dict for each
DCP save (model, optimizer) into host buffers; rank 0's planning, the write and the finish run in
the background. The copy holds every tensor of the rank's state dict, so on the busiest rank
(rank 0: FSDP2 gives it the ceiling of a dimension split over the shard group):

    sharded  = for each sharded tensor, ceil(dim 0 / S) x the other dims x its item size, where
               S = the shard group (N under fsdp, S under hsdp:S): shrinks as N grows;
    replicated = each whole replicated tensor (FSDP-ignored parameters: MOVA's text encoder and
               VAEs; AdamW's `step`), on every rank: does not shrink.

Per node, that times the ranks on a node. Item sizes: an existing checkpoint's are in its
`.metadata`; for MOVA's saves, trainable parameters and their AdamW moments are fp32 (Accelerate
upcasts the trainable parameters under mixed precision, accelerate/utils/fsdp_utils.py) and
frozen ones are bf16 (MOVA loads its models in bf16, mova_train.py's `torch_dtype`).

The stall's copy is given as a range at this host's copy rate, measured here on one thread (as
torchrun's OMP_NUM_THREADS=1 runs each rank) into a buffer allocated before, as the copy runs
after the first save: from the rank's bytes at that rate (the node's copies in parallel, each at
it) to the node's bytes at it (the node's copies serialised). Not modelled: the first save's
allocation of the buffers, the checkpoint group's three small collectives, Accelerate's own
state dicts (RNG, sampler), all of which `selftest --async` measures on the cluster.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time

from .jobs import Workload, job_specs
from .layout import Layout
from .units import fmt_b, fmt_s
from .state_dicts import CheckpointEntries, ParameterSpecs

TRAINABLE_ITEM_BYTES = 4  # fp32: Accelerate's upcast of trainable parameters under mixed precision
FROZEN_ITEM_BYTES = 2     # bf16: MOVA's torch_dtype for the models it loads
MOMENTS = 2               # AdamW's exp_avg and exp_avg_sq, each the parameter's shape, fp32
COPY_SAMPLE_BYTES = 256 * 1000 ** 2


@dataclasses.dataclass(frozen=True)
class HostCopy:
    """Rank 0's host copy of one save's state dict, in bytes."""

    save: str
    sharded: int
    replicated: int

    @property
    def total(self) -> int:
        return self.sharded + self.replicated


def rank0_share(shape: tuple[int, ...], shard: int) -> int:
    """Elements of FSDP2's Shard(0) chunk on rank 0: the ceiling of dim 0 over the shard group."""
    if not shape:
        return 1
    return min(shape[0], math.ceil(shape[0] / shard)) * math.prod(shape[1:])


def host_copies(workload: Workload, layout: Layout, ranks: int) -> list[HostCopy]:
    """Rank 0's host copy of each of the workload's saves (MOVA's, or existing checkpoints') at N ranks."""
    shard = ranks if layout.kind == "fsdp" else layout.shard
    copies, specs = [], {}
    for save in workload.saves:
        source = workload.source(save)
        key = json.dumps(source, sort_keys=True)
        if key not in specs:  # MOVA's two saves share one set of parameter specs: built once
            specs[key] = job_specs(source)
        copy = _entries_copy if isinstance(specs[key], CheckpointEntries) else _specs_copy
        copies.append(copy(specs[key], save, shard))
    return copies


def _specs_copy(specs: ParameterSpecs, save: str, shard: int) -> HostCopy:
    sharded = replicated = 0
    for _, shape, is_sharded, trainable in specs:
        if save == "optimizer" and not trainable:
            continue
        item = TRAINABLE_ITEM_BYTES if trainable else FROZEN_ITEM_BYTES
        copies = MOMENTS if save == "optimizer" else 1
        if is_sharded:
            sharded += copies * item * rank0_share(shape, shard)
        else:
            replicated += copies * item * math.prod(shape)
        if save == "optimizer":
            replicated += TRAINABLE_ITEM_BYTES  # AdamW's `step`, a 0-dim fp32 tensor per parameter
    return HostCopy(save, sharded, replicated)


def _entries_copy(entries: CheckpointEntries, save: str, shard: int) -> HostCopy:
    sharded = replicated = 0
    for entry in entries:
        if entry.size is None:
            continue  # a pickled Python value: not in the tensor copy
        item = entry.torch_dtype().itemsize
        if entry.sharded:
            sharded += item * rank0_share(entry.size, shard)
        else:
            replicated += item * math.prod(entry.size)
    return HostCopy(save, sharded, replicated)


def copy_rate(nbytes: int = COPY_SAMPLE_BYTES, repeats: int = 5) -> float:
    """Bytes per second of a one-thread copy into a preallocated buffer on this host (median)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        source = torch.ones(nbytes, dtype=torch.uint8)
        target = torch.empty_like(source)
        target.copy_(source)  # first touch of the target's pages, as the first save's allocation
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            target.copy_(source)
            times.append(time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)
    return nbytes / sorted(times)[len(times) // 2]


def predict(workload: Workload, layout: Layout, ranks: int, ranks_per_node: int, rate: float | None = None) -> dict:
    """The record `check --async` reports: rank 0's copy per save, per rank and per node, and
    the range of its copy time at this host's rate (measured unless given)."""
    copies = host_copies(workload, layout, ranks)
    per_rank = sum(c.total for c in copies)
    per_node = per_rank * min(ranks_per_node, ranks)
    rate = copy_rate() if rate is None else rate
    return {"ranks": ranks, "layout": str(layout), "ranks_per_node": min(ranks_per_node, ranks),
            "saves": [dataclasses.asdict(c) | {"total": c.total} for c in copies],
            "per_rank_bytes": per_rank, "per_node_bytes": per_node, "copy_rate_bytes_per_s": rate,
            "stall_copy_s": [per_rank / rate, per_node / rate]}


def format_lines(record: dict, planning_s: dict[str, float], finish_s: dict[str, float],
                 free: tuple[int, str] | None) -> list[str]:
    """The lines `check --async` prints under its table: the copy, its time, what moves to the background."""
    nodes = record["ranks_per_node"]
    lines = [f"async save (async_save=True) at N={record['ranks']} ({record['layout']}): rank 0's host copy"]
    for c in record["saves"]:
        lines.append(f"  {c['save']:<22} {fmt_b(c['total'], 3):>8}  ({fmt_b(c['sharded'], 3)} its shards, "
                     f"{fmt_b(c['replicated'], 3)} replicated on every rank)")
    lines.append(f"  per rank {fmt_b(record['per_rank_bytes'], 3)}, per node of {nodes} rank(s) "
                 f"{fmt_b(record['per_node_bytes'], 3)}" + (f"; this host has {fmt_b(free[0], 3)} free ({free[1]})"
                                                         if free else ""))
    low, high = record["stall_copy_s"]
    lines.append(f"  training waits for the copy: {fmt_s(low)} to {fmt_s(high)} at this host's one-thread copy rate "
                 f"({fmt_b(record['copy_rate_bytes_per_s'], 3)}/s; the node's copies in parallel to one after another), "
                 f"plus the first save's allocation and three small collectives (not modelled)")
    saves = " + ".join(planning_s)
    lines.append(f"  in the background: rank 0's planning with the fix ({saves}: "
                 f"{' + '.join(fmt_s(s) for s in planning_s.values())}), the write, and rank 0's finish "
                 f"({' + '.join(fmt_s(s) for s in finish_s.values())})")
    return lines

"""A DCP load at N ranks, on torch's own code, in one process: what every rank and rank 0 pay.

The checkpoint is the one a save of MOVA's state dict at N ranks writes (check/save_phases.py builds that
state dict with meta DTensors under torch's fake process group):

* stock-written: what `FileSystemWriter` writes, one chunk list object per tensor and one storage
  entry per chunk, built from the derived metadata (its chunk lists copied per tensor, so the
  pickle shares nothing, as stock's does not);
* ours-written: what `ScalableFileSystemWriter` writes, the same `.metadata` with chunk lists
  shared between tensors of one layout and the storage index pickled from columns, plus the
  index file (fix/index.py).

Measured for each, with the garbage collector on, as torch runs: the metadata file's size, the
read + unpickle every rank does (`FileSystemReader.read_metadata` for stock, `ScalableFileSystemReader`
for ours) in CPU seconds, and the memory it leaves (RSS growth); every rank's local read plan
(`DefaultLoadPlanner` vs `ScalableLoadPlanner`, the same read items); rank 0's share of the plan
exchange: the N local plans it unpickles and pickles back (stock) or N markers (ours), and the
bytes to and from rank 0, every payload padded to the largest as `gather_object` and
`scatter_object_list` do. Other ranks' read plans have rank 0's size (each reads one chunk per
tensor under FSDP or HSDP when the world size is the saving one), so rank 0's exchange is
measured with N copies of rank 0's plan. It runs as `jobs.py`'s jobs; `load_model.py` drives them
across N, layouts and stacks and extrapolates what cannot be held in memory.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import pickle
import time
from pathlib import Path

from .layout import Layout
from .fake_world import init_fake_world, peak_rss_bytes, rss_bytes
from .state_dicts import METADATA, build_state_dict


def derived_metadata(save: str, specs, ranks: int, layout: Layout, rank: int = 0):
    """(the metadata rank 0 derives, with chunk lists shared; the state dict of `rank`)."""
    from ..fix.planner import ScalableSavePlanner, checked

    state_dict = build_state_dict(save, specs, layout, init_fake_world(rank, ranks, layout))
    planner = ScalableSavePlanner()
    planner.set_up_planner(state_dict, None, rank == 0)
    planner.create_local_plan()
    metadata = planner.derived_metadata()
    if planner.flatten_state_dict:
        metadata = dataclasses.replace(metadata, planner_data=planner.mappings)
    return checked(metadata), state_dict


def storage_rows(metadata, ranks: int):
    """One storage entry per listed chunk, keys sorted, chunks in list order (the index's row order):
    (key number, chunk position or -1 for bytes, file number, offset, length) as int64 tensors. The
    chunk at position i lives in rank i % N's file; offsets and lengths are nominal and 64-bit wide:
    a pickled int's size depends on its width only."""
    import torch

    keys = sorted(metadata.state_dict_metadata)
    counts = [len(getattr(metadata.state_dict_metadata[k], "chunks", (None,))) for k in keys]
    is_bytes = torch.tensor([not hasattr(metadata.state_dict_metadata[k], "chunks") for k in keys])
    key = torch.repeat_interleave(torch.arange(len(keys)), torch.tensor(counts))
    first = torch.cumsum(torch.tensor(counts), 0) - torch.tensor(counts)
    chunk = torch.arange(len(key)) - first[key]
    chunk = torch.where(is_bytes[key], torch.full_like(chunk, -1), chunk)
    rows = torch.arange(len(key), dtype=torch.int64)
    return key, chunk, chunk.clamp(min=0) % ranks, rows << 20, torch.full_like(rows, 4096)


def stock_written(metadata, ranks: int):
    """The `.metadata` FileSystemWriter writes for this checkpoint: nothing shared between tensors."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata

    sdm = {fqn: TensorStorageMetadata(md.properties, md.size, copy.deepcopy(md.chunks))
           if isinstance(md, TensorStorageMetadata) else md for fqn, md in metadata.state_dict_metadata.items()}
    keys = sorted(sdm)
    storage = {}
    for k, c, f, o, n in zip(*(t.tolist() for t in storage_rows(metadata, ranks))):
        md = sdm[keys[k]]
        index = MetadataIndex(keys[k]) if c < 0 else MetadataIndex(keys[k], md.chunks[c].offsets, c)
        storage[index] = _StorageInfo(f"__{f}_0.distcp", o, n)
    return Metadata(sdm, planner_data=metadata.planner_data, storage_data=storage)


def write_stock(save: str, specs, ranks: int, layout: Layout, directory: Path) -> dict:
    """`.metadata` as stock DCP writes it for this save; its size."""
    metadata, _ = derived_metadata(save, specs, ranks, layout)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / METADATA).write_bytes(pickle.dumps(stock_written(metadata, ranks)))
    return {"metadata_bytes": (directory / METADATA).stat().st_size}


def write_ours(save: str, specs, ranks: int, layout: Layout, directory: Path, with_metadata: bool) -> dict:
    """What ScalableFileSystemWriter writes: the index, and (with_metadata) the stock-readable
    `.metadata` with its storage index pickled from columns (O(entries) Python objects to build, so
    the driver asks for it up to a size; the index needs none)."""
    import array

    import torch

    from ..fix.index import INDEX_NAME, IndexColumns, write_index
    from ..fix.storage import StorageColumns, WrittenItems, _with_storage_columns

    metadata, _ = derived_metadata(save, specs, ranks, layout)
    directory.mkdir(parents=True, exist_ok=True)
    key, chunk, path, offset, length = storage_rows(metadata, ranks)
    paths = [f"__{r}_0.distcp" for r in range(ranks)]
    sizes = {}
    if with_metadata:
        written = WrittenItems(paths, *(array.array("q", t.tolist()) for t in (key, chunk, path, offset, length)))
        blob = pickle.dumps(_with_storage_columns(metadata, StorageColumns([written], metadata)))
        (directory / METADATA).write_bytes(blob)
        sizes["metadata_bytes"] = len(blob)
    else:
        (directory / METADATA).write_bytes(b"")  # the index names the .metadata it describes
    write_index(directory, metadata, IndexColumns(paths, path.to(torch.int32), offset, length))
    sizes["index_bytes"] = (directory / INDEX_NAME).stat().st_size
    return sizes


def measure_read(directory: Path, reader: str) -> dict:
    """One rank's read of the metadata (in this fresh process): CPU seconds and memory left."""
    from ..fix.index import read_index

    gc.collect()
    before = rss_bytes()
    start = time.process_time()
    if reader == "stock":
        from torch.distributed.checkpoint import FileSystemReader
        metadata = FileSystemReader(str(directory)).read_metadata()
    else:
        metadata = read_index(directory)
    seconds = time.process_time() - start
    gc.collect()
    held = rss_bytes() - before
    chunks = sum(len(getattr(md, "chunks", ())) for md in metadata.state_dict_metadata.values())
    return {"read_s": seconds, "held_bytes": max(0, held), "peak_rss_bytes": peak_rss_bytes(),
            "chunks_listed": chunks}


def flat_state(state_dict: dict) -> dict:
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    return flatten_state_dict(state_dict)[0]


def read_plan_signature(plan) -> list[list]:
    """A read plan's items as plain values (what the simulated and the real plans must agree on)."""
    return [[item.type.name, item.dest_index.fqn, list(item.dest_index.offset or ()), list(item.dest_offsets),
             list(item.storage_index.offset or ()), list(item.storage_offsets), list(item.lengths)]
            for item in plan.items]


def simulated_read_plans(save: str, specs, ranks: int, layout: Layout) -> list[list]:
    """Every rank's stock read plan when the checkpoint saved at `ranks` loads at `ranks`."""
    from torch.distributed.checkpoint.default_planner import create_default_local_load_plan

    metadata, _ = derived_metadata(save, specs, ranks, layout)
    plans = []
    for rank in range(ranks):
        state_dict = build_state_dict(save, specs, layout, init_fake_world(rank, ranks, layout))
        plans.append(read_plan_signature(create_default_local_load_plan(flat_state(state_dict), metadata)))
    return plans


def measure_planning(save: str, specs, ranks: int, layout: Layout, repeats: int = 2) -> dict:
    """Rank 0's local read plan (stock and ours, on the same shared-list metadata: stock's cost does
    not depend on sharing) and rank 0's share of the plan exchange, GC on."""
    from torch.distributed.checkpoint.default_planner import create_default_local_load_plan
    from torch.distributed.checkpoint.planner import LoadPlan

    from ..fix.load_planner import KeepYourPlan, read_items

    metadata, state_dict = derived_metadata(save, specs, ranks, layout)
    flat = flat_state(state_dict)
    best = {"local plan: stock": float("inf"), "local plan: ours": float("inf")}
    for _ in range(repeats):
        for name, build in (("local plan: stock", lambda: create_default_local_load_plan(flat, metadata).items),
                            ("local plan: ours", lambda: read_items(flat, metadata))):
            start = time.process_time()
            items = build()
            best[name] = min(best[name], time.process_time() - start)
    plan = LoadPlan(items)
    exchange = {"stock": _exchange(pickle.dumps(plan), ranks), "ours": _exchange(
        pickle.dumps(LoadPlan([], planner_data=KeepYourPlan(len(items)))), ranks)}
    return {"ranks": ranks, "items_per_rank": len(items), "local_plan_s": best, "exchange": exchange}


def _exchange(payload: bytes, ranks: int, max_materialised: int = 256) -> dict:
    """Rank 0 in the plan exchange: unpickle N plans, return them (the identity), pickle N plans.
    Timed with min(N, max_materialised) plans held at once, scaled to N (each plan costs the same)."""
    held = min(ranks, max_materialised)
    gc.collect()
    before = rss_bytes()
    start = time.process_time()
    plans = [pickle.loads(payload) for _ in range(held)]
    unpickle_s = time.process_time() - start
    memory = rss_bytes() - before
    start = time.process_time()
    back = [pickle.dumps(p) for p in plans]
    pickle_s = time.process_time() - start
    scale = ranks / held
    return {"unpickle_s": unpickle_s * scale, "pickle_s": pickle_s * scale, "plans_held_bytes": max(0, memory) * scale,
            "bytes_to_rank0": ranks * len(payload), "bytes_from_rank0": ranks * max(map(len, back)),
            "plan_bytes": len(payload), "measured_plans": held}

"""One rank of the stock-equivalence harness (started by tests/fix/test_equivalence.py).

    python equivalence_job.py CASES.json OUT save      save every case with stock and with ours, load both back
    python equivalence_job.py CASES.json OUT reshard   load ours' checkpoints at this (other) world size

A case is a random state dict (DTensors on 1-D, 2-D and sub-meshes; Shard, Replicate and
FSDP x TP's _StridedShard; uneven and empty shards; 0-d tensors; float32, bfloat16, bool,
uint8 and int64; nested containers; objects; keys some ranks lack; values that differ across
ranks) and a way of saving it: DefaultSavePlanner's options (flatten_state_dict,
dedup_save_to_lowest_rank, enable_plan_caching with a second save) and dcp's call modes
(save, async_save on a checkpoint group, two subgroups saving at once, no_dist). Every value
is a function of its key (and, for "differ" keys, the rank), so any world size knows what a
loaded shard must hold. Each rank writes OUT/<op>.rank<N>.json: per case, what it saw.
"""

import datetime
import hashlib
import json
import os
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner, FileSystemReader, FileSystemWriter
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

from ckptdoctor.fix.planner import ScalableSavePlanner, coverage_problems
from ckptdoctor.fix.storage import ScalableFileSystemWriter

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "bool": torch.bool, "uint8": torch.uint8,
          "int64": torch.int64}


def full_value(key: str, shape, dtype: str, rank_salt: int = 0) -> torch.Tensor:
    seed = int.from_bytes(hashlib.sha256(f"{key}|{rank_salt}".encode()).digest()[:4], "little")
    gen = torch.Generator().manual_seed(seed)
    if dtype == "bool":
        return torch.rand(shape, generator=gen) > 0.5
    if dtype in ("uint8", "int64"):
        return torch.randint(0, 200, shape, generator=gen, dtype=DTYPES[dtype])
    return torch.randn(shape, generator=gen).to(DTYPES[dtype])


class Meshes:
    def __init__(self, world: int):
        self.one = init_device_mesh("cpu", (world,))
        self.two = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("rep", "shard")) if world >= 4 else None

    def get(self, name: str):
        if name == "1d" or self.two is None:
            return self.one
        return self.two if name in ("2d", "fsdp_tp") else self.two["shard"]


def placements_of(entry: dict, mesh) -> list:
    if entry["mesh"] == "fsdp_tp" and mesh.ndim == 2:  # FSDP2 over TP: dim 0 split by both
        return [_StridedShard(0, split_factor=mesh.size(1)), Shard(0)]
    out = []
    for p in entry["placements"][:mesh.ndim] + [None] * (mesh.ndim - len(entry["placements"])):
        out.append(Replicate() if p is None or p >= len(entry["shape"]) else Shard(p))
    return out


def build(case: dict, meshes: Meshes, rank: int, zeros: bool = False) -> dict:
    """The case's state dict on this rank (zeros: a load target of the same structure)."""
    state: dict = {}
    for entry in case["entries"]:
        if entry.get("only_on") is not None and rank not in entry["only_on"] and not zeros:
            continue
        key = "/".join(map(str, entry["path"]))
        if entry["kind"] == "object":
            value = 0 if zeros else entry["value"]
        else:
            salt = rank if entry.get("differ") else 0
            full = full_value(key, tuple(entry["shape"]), entry["dtype"], salt)
            full = torch.zeros_like(full) if zeros else full
            if entry["kind"] == "dtensor":
                mesh = meshes.get(entry["mesh"])
                value = distribute_tensor(full, mesh, placements_of(entry, mesh), src_data_rank=None)
            else:
                value = full
        _set(state, entry["path"], value)
    return state


def _set(state, path, value):
    for i, part in enumerate(path[:-1]):
        nxt = path[i + 1]
        if isinstance(state, list):
            while len(state) <= part:
                state.append([] if isinstance(nxt, int) else {})
            state = state[part]
        else:
            state = state.setdefault(part, [] if isinstance(nxt, int) else {})
    if isinstance(state, list):
        while len(state) <= path[-1]:
            state.append(None)
        state[path[-1]] = value
    else:
        state[path[-1]] = value


def _get(state, path):
    for part in path:
        state = state[part]
    return state


def compare(case: dict, loaded: dict, rank: int, world: int, meshes: Meshes) -> dict:
    """Per key: "ok", or "copy of rank R" (a value that differs across ranks), or why not."""
    out = {}
    for entry in case["entries"]:
        key = "/".join(map(str, entry["path"]))
        got = _get(loaded, entry["path"])
        if entry["kind"] == "object":
            out[key] = "ok" if got == entry["value"] else f"object {got!r}"
            continue
        candidates = range(world) if entry.get("differ") else [0]
        for salt in candidates:
            want = full_value(key, tuple(entry["shape"]), entry["dtype"], salt if entry.get("differ") else 0)
            if isinstance(got, DTensor):
                want = distribute_tensor(want, got.device_mesh, got.placements, src_data_rank=None).to_local()
                got_local = got.to_local()
            else:
                got_local = got
            if got_local.dtype == want.dtype and got_local.shape == want.shape and torch.equal(got_local, want):
                out[key] = "ok" if not entry.get("differ") else f"copy of rank {salt}"
                break
        else:
            out[key] = "differs"
    return out


def planners(case: dict, ours: bool):
    opts = dict(flatten_state_dict=case["flatten"], dedup_save_to_lowest_rank=case["lowest"],
                enable_plan_caching=case["caching"])
    return ScalableSavePlanner(**opts) if ours else DefaultSavePlanner(**opts)


def writer(path: Path, ours: bool):
    return ScalableFileSystemWriter(path) if ours else FileSystemWriter(path)


def save_one(case, state, path, ours, group, rank):
    """One save in the case's call mode; returns the planner's mode (or "stock")."""
    planner = planners(case, ours)
    mode = case["mode"]
    if mode == "async":
        dcp.async_save(state, storage_writer=writer(path, ours), planner=planner, process_group=group).result()
    elif mode == "no_dist":
        dcp.save(state, storage_writer=writer(path / f"rank{rank}", ours), planner=planner, no_dist=True)
    else:
        dcp.save(state, storage_writer=writer(path, ours), planner=planner, process_group=group)
    return getattr(planner, "mode", "stock")


def checkpoint_dir(out: Path, i: int, who: str, rank: int, case: dict, meshes: Meshes) -> Path:
    base = out / f"case{i}" / who
    if case["mode"] == "subgroups":
        base = base / f"half{rank // (dist.get_world_size() // 2)}"
    return base


def run_save(cases, out: Path, rank: int, world: int) -> list[dict]:
    meshes = Meshes(world)
    ckpt_group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=120))
    halves = [dist.new_group([0, 1]), dist.new_group([2, 3])] if world == 4 else None
    results = []
    for i, case in enumerate(cases):
        forget_cached_plans()
        group = ckpt_group if case["mode"] == "async" else \
            (halves[rank // 2] if case["mode"] == "subgroups" else None)
        result = {"case": i}
        for who in ("stock", "ours"):
            path = checkpoint_dir(out, i, who, rank, case, meshes)
            try:
                for repeat in range(2 if case["caching"] else 1):  # caching: the second save reuses plans
                    target = path if repeat == 0 else path.with_name(path.name + "-again")
                    result[f"{who}_mode"] = save_one(case, build(case, meshes, rank), target, who == "ours",
                                                     group, rank)
                loaded = build(case, meshes, rank, zeros=True)
                load_path = path / f"rank{rank}" if case["mode"] == "no_dist" else path
                dcp.load(loaded, storage_reader=FileSystemReader(load_path), process_group=group,
                         planner=DefaultLoadPlanner(flatten_state_dict=case["flatten"]),
                         no_dist=case["mode"] == "no_dist")
                result[f"{who}_values"] = compare(case, loaded, rank, world, meshes)
                if case["caching"]:
                    again = build(case, meshes, rank, zeros=True)
                    dcp.load(again, storage_reader=FileSystemReader(path.with_name(path.name + "-again")),
                             planner=DefaultLoadPlanner(flatten_state_dict=case["flatten"]), process_group=group)
                    result[f"{who}_values_again"] = compare(case, again, rank, world, meshes)
                if rank in (0, world // 2) or case["mode"] == "no_dist":
                    md = FileSystemReader(load_path).read_metadata()
                    result[f"{who}_metadata"] = describe(md)
                    result[f"{who}_coverage"] = coverage_problems(
                        md, ((k.fqn, tuple(k.offset or ())) for k in md.storage_data))
            except BaseException as error:  # noqa: BLE001 - reported: the test compares ours' with stock's
                result[f"{who}_error"] = _failure_names(error)
                result[f"{who}_trace"] = traceback.format_exc()[-1500:]
        results.append(result)
    return results


def forget_cached_plans() -> None:
    """Stock plan caching is per planner class and process: meant for repeated saves of one
    state dict, so each case starts without another case's plans."""
    from torch.distributed.checkpoint.planner import SavePlanner

    for name in ("_cached_save_plan", "_cached_all_plans", "_cached_global_plan", "_cached_metadata",
                 "_cached_final_save_plan"):
        getattr(SavePlanner, name, {}).clear()


def run_reshard(cases, out: Path, rank: int, world: int) -> list[dict]:
    """Load ours' checkpoint of every plain-mode case into this world size's layout: every
    DTensor sharded on dim 0 of a 1-D mesh (Replicate when 0-d)."""
    mesh = init_device_mesh("cpu", (world,))
    results = []
    for i, case in enumerate(cases):
        if case["mode"] in ("subgroups", "no_dist"):
            results.append({"case": i, "skipped": case["mode"]})
            continue
        relaid = dict(case, entries=[dict(e, mesh="1d", placements=[0 if e["shape"] else None])
                                     if e["kind"] == "dtensor" else e for e in case["entries"]])
        meshes = Meshes(world)
        meshes.one = mesh
        try:
            loaded = build(relaid, meshes, rank, zeros=True)
            dcp.load(loaded, storage_reader=FileSystemReader(out / f"case{i}" / "ours"),
                     planner=DefaultLoadPlanner(flatten_state_dict=case["flatten"]))
            results.append({"case": i, "values": compare(relaid, loaded, rank, world, meshes)})
        except BaseException as error:  # noqa: BLE001
            results.append({"case": i, "error": _failure_names(error), "trace": traceback.format_exc()[-1500:]})
    return results


def describe(md) -> dict:
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    return {k: "bytes" if isinstance(v, BytesStorageMetadata) else
            [list(v.size), str(v.properties.dtype), getattr(v.properties, "strides", None),  # torch 2.15+
             sorted([list(c.offsets), list(c.sizes)] for c in v.chunks)]
            for k, v in md.state_dict_metadata.items()}


def _failure_names(error: BaseException) -> list[str]:
    failures = getattr(error, "failures", None) or {}
    return sorted({type(f[0] if isinstance(f, tuple) else f).__name__ for f in failures.values()}) or \
        [type(error).__name__]


def main() -> int:
    cases, out, op = json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2]), sys.argv[3]
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    results = run_save(cases, out, rank, world) if op == "save" else run_reshard(cases, out, rank, world)
    (out / f"{op}.rank{rank}.json").write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())

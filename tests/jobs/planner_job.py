"""One rank of a planner test job (started by tests/fix/test_planner.py through ckptdoctor.repro.launcher).

    python planner_job.py save DIR PLANNER [DIR PLANNER ...]
                                                 build the state dict, dcp.save it into each DIR in turn
                                                 (PLANNER: stock, ours, ours-owned = without derived metadata;
                                                  +writer: with ScalableFileSystemWriter)
    python planner_job.py load DIR [READER]      dcp.load into this world size, compare (READER: stock, or
                                                 ours = ScalableLoadPlanner + ScalableFileSystemReader, whose
                                                 read plan is also compared with stock's, item by item)
    python planner_job.py load-save DIR OUT      load (compare), then save again with ours

Every tensor is a deterministic function of its name, so any world size knows what each of
its local shards must hold. Each rank writes DIR.OP.rank<N>.json beside each DIR with what it saw.

Faults, injected by environment variable (the fix's defences are under test, not torch):
    EXTRA_KEY_ON_RANK=R       rank R holds a replicated key the others do not
    SUBMESH=1                 add a DTensor on a sub-mesh (one row of the 2-D mesh), which rank 0
                              cannot derive: the planner alone must take the owned path
    STAGE=1                   a pipeline stage's layer: only the second half of the ranks hold it, on
                              their own mesh (rank 0 neither holds nor sees it)
    UNEVEN=1                  a DTensor with fewer rows than ranks: the last ranks hold nothing of it
    DIFFER_ON_RANK=R          rank R's copy of the replicated plain.lora differs
    VERIFY_REPLICAS=1         save with ScalableSavePlanner(verify_replicas=True)
    FAIL_PLANNING_ON_RANK=R   torch's local planning raises on rank R
    DROP_WRITE_ON_RANK=R      rank R skips one chunk it owns (an ownership slip)
"""

import datetime
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from ckptdoctor import ScalableFileSystemWriter, ScalableSavePlanner
from ckptdoctor.fix.load_planner import ScalableLoadPlanner
from ckptdoctor.fix.storage import ScalableFileSystemReader

SHAPES = {"fsdp.w": (10, 7), "fsdp.down": (3, 13), "fsdp.small": (2,), "hsdp.w": (9, 5), "plain.lora": (4, 4),
          "row.w": (6, 3), "stage1.w": (5, 2), "fsdp.short": (2, 3)}


def full(name: str, shape) -> torch.Tensor:
    gen = torch.Generator().manual_seed(sum(map(ord, name)))
    return torch.randn(shape, generator=gen)


def build(rank: int, world: int, zeros: bool = False) -> dict:
    fsdp = init_device_mesh("cpu", (world,))
    hsdp = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    value = (lambda n: torch.zeros(SHAPES[n])) if zeros else (lambda n: full(n, SHAPES[n]))
    state = {
        "fsdp": {"w": distribute_tensor(value("fsdp.w"), fsdp, [Shard(0)]),
                 "down": distribute_tensor(value("fsdp.down"), fsdp, [Shard(1)]),
                 "small": distribute_tensor(value("fsdp.small"), fsdp, [Shard(0)])},
        "hsdp": {"w": distribute_tensor(value("hsdp.w"), hsdp, [Replicate(), Shard(0)])},
        "plain": {"lora": value("plain.lora"), "step": torch.tensor(0.0 if zeros else 7.0)},
        "param_groups": [{"lr": 0.0 if zeros else 1e-4, "params": ["fsdp.w", "fsdp.down"]}],
    }
    if os.environ.get("SUBMESH") == "1":  # every row holds its own full copy, sharded over the row
        state["row"] = {"w": distribute_tensor(value("row.w"), hsdp["shard"], [Shard(0)])}
    if os.environ.get("STAGE") == "1" and rank >= world // 2:  # stage 1's ranks, sharded over their own row
        state["stage1"] = {"w": distribute_tensor(value("stage1.w"), hsdp["shard"], [Shard(0)])}
    if os.environ.get("UNEVEN") == "1":
        state["fsdp"]["short"] = distribute_tensor(value("fsdp.short"), fsdp, [Shard(0)])
    if os.environ.get("EXTRA_KEY_ON_RANK") == str(rank):  # ranks disagree on the replicated keys
        state["plain"]["only_here"] = torch.ones(3)
    if os.environ.get("DIFFER_ON_RANK") == str(rank) and not zeros:
        state["plain"]["lora"] = state["plain"]["lora"] + 1.0
    return state


def inject_faults(rank: int) -> None:
    if os.environ.get("FAIL_PLANNING_ON_RANK") == str(rank):

        def create_local_plan(self):
            raise RuntimeError(f"injected planning failure on rank {rank}")
        dcp.DefaultSavePlanner.create_local_plan = create_local_plan
    if os.environ.get("DROP_WRITE_ON_RANK") == str(rank):
        original_finish = ScalableSavePlanner.finish_plan

        def finish_plan(self, new_plan):
            plan = original_finish(self, new_plan)
            self.plan = plan = type(plan)(plan.items[1:], storage_data=plan.storage_data, usable=True)
            return plan
        ScalableSavePlanner.finish_plan = finish_plan


def failure_names(error: BaseException) -> list[str]:
    """The exception types inside a DCP CheckpointException, by rank (or the error's own)."""
    failures = getattr(error, "failures", None) or {}
    return sorted({type(f[0] if isinstance(f, tuple) else f).__name__ for f in failures.values()}) or \
        [type(error).__name__]


def mismatches(state: dict) -> list[str]:
    """Names whose local values differ from the expected ones, bit for bit."""
    bad = []
    for group, values in state.items():
        if group == "param_groups":
            if values != [{"lr": 1e-4, "params": ["fsdp.w", "fsdp.down"]}]:
                bad.append("param_groups")
            continue
        for key, tensor in values.items():
            name = f"{group}.{key}"
            if key == "step":
                ok = tensor.item() == 7.0
            elif isinstance(tensor, DTensor):
                expected = distribute_tensor(full(name, SHAPES[name]), tensor.device_mesh, tensor.placements)
                ok = torch.equal(tensor.to_local(), expected.to_local())
            else:
                ok = key == "only_here" or torch.equal(tensor, full(name, SHAPES[name]))
            if not ok:
                bad.append(name)
    return bad


def stock_load_plan(path: Path, rank: int, world: int):
    """The read plan stock's DefaultLoadPlanner makes on this rank for the same state dict."""
    state = build(rank, world, zeros=True)
    planner = dcp.DefaultLoadPlanner()
    planner.set_up_planner({key: state[key] for key in sorted(state)},  # as dcp.load orders the top-level keys
                           dcp.FileSystemReader(path).read_metadata(), rank == 0)
    return planner.create_local_plan()


def read_plan(plan) -> list:
    """Every read item's fields, in order (MetadataIndex's index hint included)."""
    return [(i.type.name, i.dest_index.fqn, tuple(i.dest_index.offset or ()), i.dest_index.index,
             tuple(i.dest_offsets), i.storage_index.fqn, tuple(i.storage_index.offset or ()),
             i.storage_index.index, tuple(i.storage_offsets), tuple(i.lengths)) for i in plan.items]


def save(rank: int, world: int, path: Path, how: str) -> dict:
    """One dcp.save of the state dict into `path` with planner (and writer) `how`; what this rank saw."""
    kind, with_writer = how.removesuffix("+writer"), how.endswith("+writer")
    verify = os.environ.get("VERIFY_REPLICAS") == "1"
    planner = {"ours": lambda: ScalableSavePlanner(verify_replicas=verify),
               "ours-owned": lambda: ScalableSavePlanner(derive_metadata=False, verify_replicas=verify),
               "stock": dcp.DefaultSavePlanner}[kind]()
    writer = ScalableFileSystemWriter(path) if with_writer else None
    report, start = {"rank": rank, "world": world}, time.time()
    try:
        returned = dcp.save(build(rank, world), checkpoint_id=path, planner=planner, storage_writer=writer)
    except BaseException as error:  # noqa: BLE001 - reported, then the job goes on to the next save
        report.update(failed=failure_names(error), error=str(error)[-2000:], save_s=time.time() - start)
        return report
    report["save_s"] = time.time() - start
    report["returned_storage_data"] = None if returned.storage_data is None else len(returned.storage_data)
    report["returned_chunks"] = sum(len(getattr(md, "chunks", [])) for md in returned.state_dict_metadata.values())
    report["items_written"] = len(planner.plan.items)
    meta = returned.storage_meta
    report["returned_checkpoint_id"] = None if meta is None else str(meta.checkpoint_id)
    report["mode"] = getattr(planner, "mode", "stock planner")
    return report


def load(rank: int, world: int, path: Path, op: str, extra: list[str]) -> dict:
    """dcp.load into this world size and compare every value (then, for load-save, save again with ours)."""
    report = {"rank": rank, "world": world}
    state = build(rank, world, zeros=True)
    if op == "load" and extra == ["ours"]:
        planner = ScalableLoadPlanner()
        start = time.time()
        dcp.load(state, checkpoint_id=path, planner=planner, storage_reader=ScalableFileSystemReader(path))
        report["load_s"] = time.time() - start
        ours, stock = read_plan(planner.plan), read_plan(stock_load_plan(path, rank, world))
        report["plan_equals_stock"] = ours == stock
        report["plan_difference"] = next(([a, b] for a, b in zip(ours, stock) if a != b), len(ours) - len(stock))
        report["items_read"] = len(planner.plan.items)
    else:
        dcp.load(state, checkpoint_id=path)  # stock loader and planner
    report["mismatches"] = mismatches(state)
    if op == "load-save":
        out = Path(extra[0])
        dcp.save(state, checkpoint_id=out, planner=ScalableSavePlanner(), storage_writer=ScalableFileSystemWriter(out))
    return report


def main() -> int:
    op = sys.argv[1]
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    if op == "save":  # DIR PLANNER [DIR PLANNER ...]: one launch serves several saves, in order
        inject_faults(rank)
        for path, how in zip(sys.argv[2::2], sys.argv[3::2]):
            Path(f"{path}.save.rank{rank}.json").write_text(json.dumps(save(rank, world, Path(path), how)))
    else:
        path = Path(sys.argv[2])
        Path(f"{path}.{op}.rank{rank}.json").write_text(json.dumps(load(rank, world, path, op, sys.argv[3:])))
    dist.destroy_process_group()
    return 0

if __name__ == "__main__":
    code = main()
    # The report is written and the groups destroyed. After a failed save, the newest torch's gloo
    # worker threads have once aborted interpreter finalization here ("terminate called without an
    # active exception", CI; cf. pytorch/pytorch#190489), so leave without finalizing.
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(code)

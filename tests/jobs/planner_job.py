"""One rank of a planner test job (started by tests/fix/test_planner.py through ckptdoctor.repro.launcher).

    python planner_job.py save DIR PLANNER       build the state dict, dcp.save it
                                                 (PLANNER: stock, ours, ours-owned = without derived metadata,
                                                  ours+writer = with ScalableFileSystemWriter)
    python planner_job.py load DIR               stock dcp.load into this world size, compare
    python planner_job.py load-save DIR OUT      load (compare), then save again with ours

Every tensor is a deterministic function of its name, so any world size knows what each of
its local shards must hold. Each rank writes rank<N>.json beside DIR with what it saw.
"""

import datetime
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from ckptdoctor import ScalableFileSystemWriter, ScalableSavePlanner

SHAPES = {"fsdp.w": (10, 7), "fsdp.down": (3, 13), "fsdp.small": (2,), "hsdp.w": (9, 5), "plain.lora": (4, 4)}


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
    if os.environ.get("EXTRA_KEY_ON_RANK") == str(rank):  # ranks disagree on the replicated keys
        state["plain"]["only_here"] = torch.ones(3)
    return state


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


def main() -> int:
    op, path = sys.argv[1], Path(sys.argv[2])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    report = {"rank": rank, "world": world}
    if op == "save":
        planners = {"ours": ScalableSavePlanner, "ours-owned": lambda: ScalableSavePlanner(derive_metadata=False),
                    "ours+writer": ScalableSavePlanner, "stock": dcp.DefaultSavePlanner}
        planner = planners[sys.argv[3]]()
        writer = ScalableFileSystemWriter(path) if sys.argv[3].endswith("+writer") else None
        returned = dcp.save(build(rank, world), checkpoint_id=path, planner=planner, storage_writer=writer)
        report["returned_storage_data"] = None if returned.storage_data is None else len(returned.storage_data)
        report["items_written"] = len(planner.plan.items)
        report["replicas_agree"] = getattr(planner, "replicas_agree", None)
        report["mode"] = getattr(planner, "mode", "stock planner")
    else:
        state = build(rank, world, zeros=True)
        dcp.load(state, checkpoint_id=path)  # stock loader and planner
        report["mismatches"] = mismatches(state)
        if op == "load-save":
            out = Path(sys.argv[3])
            dcp.save(state, checkpoint_id=out, planner=ScalableSavePlanner(), storage_writer=ScalableFileSystemWriter(out))
    Path(f"{path}.{op}.rank{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""One rank of a pipeline-parallel job, 2 stages x 2 ranks, FSDP2 inside each stage (started by
tests/fix/test_planner.py through ckptdoctor.repro.launcher).

    python pipeline_job.py OUT

The world's 4 ranks form a (pp=2, dp=2) mesh. Each stage holds its own layers of one model
(stage 0: the embedding and blocks 0-1; stage 1: blocks 2-3 and the head), sharded with
`fully_shard` over its stage's dp sub-mesh, and trains with AdamW. The microbatches flow
through torch.distributed.pipelining (PipelineStage + ScheduleGPipe: activations and gradients
sent between the stages over gloo). Then, as torchtitan saves a PP job, every rank passes its
own stage's model and optimizer state dicts (original FQNs, so the stages' keys differ, each
stage's DTensors on its own sub-mesh) to one dcp.save on the default group:

1. OUT/ours with ScalableSavePlanner and ScalableFileSystemWriter (no ScalableCheckpointing);
2. OUT/stock with torch's defaults;
then loads OUT/ours back with stock dcp.load into fresh zeros of the same layout and compares
every value with what was saved, bit for bit. Each rank writes OUT/rank<N>.json.
"""

import datetime
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe
from torch.distributed.tensor import DTensor

from ckptdoctor import ScalableFileSystemWriter, ScalableSavePlanner

WIDTH, BLOCKS, MICROBATCHES = 16, 4, 2


class Stage(torch.nn.Module):
    """Stage `s` of a 4-block MLP: the first holds the embedding, the last the head."""

    def __init__(self, stage: int):
        super().__init__()
        torch.manual_seed(0)  # every stage builds the whole model, then keeps its own layers:
        embed, blocks, head = (torch.nn.Linear(8, WIDTH), torch.nn.ModuleList(torch.nn.Linear(WIDTH, WIDTH)
                               for _ in range(BLOCKS)), torch.nn.Linear(WIDTH, 4))
        half = BLOCKS // 2
        self.embed = embed if stage == 0 else None
        self.layers = torch.nn.ModuleDict({str(i): blocks[i] for i in range(stage * half, (stage + 1) * half)})
        self.head = head if stage == 1 else None

    def forward(self, x):
        if self.embed is not None:
            x = self.embed(x)
        for layer in self.layers.values():
            x = torch.relu(layer(x))
        return self.head(x) if self.head is not None else x


def values(state: dict) -> dict:
    """Every tensor's local values (a DTensor's own shard), by key, on CPU."""
    flat = {}

    def walk(prefix, value):
        if isinstance(value, dict):
            for key, inner in value.items():
                walk(f"{prefix}.{key}" if prefix else str(key), inner)
        elif isinstance(value, DTensor):
            flat[prefix] = value.to_local().clone()
        elif isinstance(value, torch.Tensor):
            flat[prefix] = value.clone()
    walk("", state)
    return flat


def zeroed(state):
    if isinstance(state, dict):
        return {k: zeroed(v) for k, v in state.items()}
    if isinstance(state, DTensor):
        return DTensor.from_local(torch.zeros_like(state.to_local()), state.device_mesh, state.placements,
                                  shape=state.shape, stride=state.stride())
    if isinstance(state, torch.Tensor):
        return torch.zeros_like(state)
    return state


def main() -> int:
    out = Path(sys.argv[1])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    stage_index = mesh.get_local_rank("pp")
    model = Stage(stage_index)
    for layer in model.layers.values():
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    stage = PipelineStage(model, stage_index, 2, torch.device("cpu"), group=mesh["pp"].get_group())
    schedule = ScheduleGPipe(stage, MICROBATCHES, loss_fn=lambda y, target: torch.nn.functional.mse_loss(y, target))
    torch.manual_seed(100 + mesh.get_local_rank("dp"))  # each data-parallel replica its own batch
    batch, target = torch.randn(4, 8), torch.randn(4, 4)
    for _ in range(2):
        optimizer.zero_grad()
        if stage_index == 0:
            schedule.step(batch)
        else:
            schedule.step(target=target)
        optimizer.step()
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}
    report = {"rank": rank, "stage": stage_index, "keys": sorted(values(state))}
    planner = ScalableSavePlanner()
    dcp.save(state, planner=planner, storage_writer=ScalableFileSystemWriter(out / "ours"))
    report["mode"] = planner.mode
    dcp.save(state, checkpoint_id=out / "stock")
    loaded = zeroed(state)
    dcp.load(loaded, checkpoint_id=out / "ours")  # stock dcp.load
    saved, back = values(state), values(loaded)
    report["compared"] = len(saved)
    report["differ"] = sorted(k for k in saved if not torch.equal(saved[k], back[k]))
    report["nonzero"] = sum(int(v.count_nonzero()) for v in back.values())
    (out / f"rank{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

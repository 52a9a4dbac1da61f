"""One rank of the wheel test: save with the installed wheel's planner and writer, load back
with stock DCP, compare bit for bit (started by tests/packaging/test_wheel.py).

    python wheel_job.py DIR
"""

import datetime
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

import ckptdoctor
from ckptdoctor import ScalableFileSystemWriter, ScalableSavePlanner


def state(mesh, fill=None) -> dict:
    full = torch.arange(60, dtype=torch.float32).reshape(10, 6) if fill is None else torch.full((10, 6), fill)
    step = torch.tensor(3.0 if fill is None else fill)
    return {"w": distribute_tensor(full, mesh, [Shard(0)]), "step": step, "groups": [{"lr": 1e-4}]}


def main() -> int:
    path = Path(sys.argv[1])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    planner = ScalableSavePlanner()
    dcp.save(state(mesh), checkpoint_id=path, planner=planner, storage_writer=ScalableFileSystemWriter(path))
    loaded = state(mesh, fill=-1.0)
    dcp.load(loaded, checkpoint_id=path)
    expected = state(mesh)
    mismatches = [k for k in ("w", "step") if not torch.equal(
        getattr(loaded[k], "to_local", lambda: loaded[k])(), getattr(expected[k], "to_local", lambda: expected[k])())]
    mismatches += [] if loaded["groups"] == expected["groups"] else ["groups"]
    Path(f"{path}.rank{dist.get_rank()}.json").write_text(json.dumps(
        {"ckptdoctor": ckptdoctor.__file__, "mode": planner.mode, "mismatches": mismatches}))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The job as the user's launcher started it: rank, world, device and the backend to use."""

from __future__ import annotations

import dataclasses
import datetime
import os

from ..errors import CkptDoctorError
from ..ports import free_port


@dataclasses.dataclass(frozen=True)
class Job:
    rank: int
    world_size: int
    local_rank: int
    device: str      # "npu", "cuda" or "cpu"
    backend: str     # what init_process_group was given

    def torch_device(self):
        import torch

        return torch.device("cpu") if self.device == "cpu" else torch.device(self.device, self.local_rank)


def detect_device() -> tuple[str, str]:
    """(device, backend) of this host: torch_npu -> HCCL beside gloo, CUDA -> NCCL beside gloo,
    else gloo alone. DCP's object collectives run on gloo in every case."""
    import torch

    try:
        import torch_npu  # noqa: F401 - registers the npu device
        return "npu", "cpu:gloo,npu:hccl"
    except ImportError:
        pass
    if torch.cuda.is_available():
        return "cuda", "cpu:gloo,cuda:nccl"
    return "cpu", "gloo"


def start(backend: str | None, timeout_s: float) -> Job:
    """init_process_group from the launcher's environment (torchrun, accelerate launch); alone,
    a world of one on this host."""
    import torch
    import torch.distributed as dist

    device, detected = detect_device()
    backend = backend or detected
    if device != "cpu" and backend == "gloo":
        device = "cpu"  # asked for gloo only: the model stays on the CPU
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(free_port()))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device == "npu":
        torch.npu.set_device(local_rank)
    elif device == "cuda":
        torch.cuda.set_device(local_rank)
    try:
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    except (ValueError, RuntimeError) as error:
        raise CkptDoctorError(f"cannot start the process group with backend {backend!r}: {error}") from None
    return Job(dist.get_rank(), dist.get_world_size(), local_rank, device, backend)

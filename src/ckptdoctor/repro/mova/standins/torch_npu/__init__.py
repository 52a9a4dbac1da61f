"""Stand-in for torch_npu on a machine without Ascend NPUs (see ../README.md)."""

import types

import torch
import torch.distributed as dist

__version__ = "0.0.0+ckptdoctor-standin"


class _Stream:
    def synchronize(self) -> None:
        pass


def _is_available() -> bool:
    return False


npu = types.ModuleType("torch_npu.npu")
npu.is_available = _is_available
npu.device_count = lambda: 0
npu.current_stream = lambda *args, **kwargs: _Stream()
npu.set_compile_mode = lambda **kwargs: None
npu.set_per_process_memory_fraction = lambda *args, **kwargs: None
npu.synchronize = lambda *args, **kwargs: None
npu.config = types.SimpleNamespace(allow_internal_format=False)


def fast_gelu(x):
    return torch.nn.functional.gelu(x, approximate="tanh")


def npu_rms_norm(x, weight, epsilon=1e-6):
    return (x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + epsilon)).type_as(x) * weight, None


def npu_rotary_mul(x, cos, sin):
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


_init_process_group = dist.init_process_group


def init_process_group(backend=None, *args, **kwargs):
    """No NPU, so no HCCL: the "npu:hccl" half of a multi-device backend string is dropped
    ("cpu:gloo,npu:hccl" -> "gloo"). The collectives under study run on its gloo half anyway."""
    if isinstance(backend, str) and "npu:hccl" in backend:
        backend = ",".join(part for part in backend.split(",") if not part.startswith("npu:")).replace("cpu:", "")
    return _init_process_group(backend, *args, **kwargs)


if dist.init_process_group is not init_process_group:
    init_process_group.__wrapped__ = _init_process_group
    dist.init_process_group = init_process_group
if not hasattr(torch, "npu"):
    torch.npu = npu  # what torch_npu adds; it reports no NPU, so Accelerate stays on the CPU

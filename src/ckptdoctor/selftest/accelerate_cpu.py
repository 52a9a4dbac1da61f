"""The smallest change that runs Accelerate's own FSDP2 path on CPU processes.

Why a change is needed: Accelerate turns on FSDP only for accelerator device types
(`AcceleratorState.__init__` checks `distributed_type in [MULTI_GPU, MULTI_NPU, ...]`);
a CPU job is MULTI_CPU and would silently fall back to plain data parallel, so
`save_state` would never reach `save_fsdp_model` / `save_fsdp_optimizer`.

What we change, before the `Accelerator` is built and nothing else:
`PartialState(cpu=True).distributed_type = MULTI_GPU`. `PartialState` keeps its fields in a
shared dict, so the `AcceleratorState` built next reads MULTI_GPU and enables FSDP; the
device stays CPU because `cpu=True` set it. Every save and load function stays
Accelerate's and torch's own, unmodified. (Setting the type on `accelerator.state` after
construction does not stick: prepare falls back and `save_state` skips the FSDP branch.)

`unpinned_cpu_offload()`: Accelerate turns a trainer's `cpu_offload=True` (MOVA's) into
`CPUOffloadPolicy()`, whose default `pin_memory=True` needs an accelerator ("CPU device type
not an accelerator"). Until undone, the policy class Accelerate imports at that moment
defaults to `pin_memory=False`; every other field is torch's.

Used by `ckptdoctor selftest` on CPU-only hosts and by the lab (repro); on NPU and CUDA hosts
Accelerate takes its FSDP path by itself and none of this runs.
"""

from __future__ import annotations

from ..fix.compat import check_versions


def _check_accelerate_version() -> None:
    check_versions("the CPU FSDP shim")  # PartialState's shared fields: read from the checked versions


def enable_fsdp_on_cpu() -> None:
    """Make the next `Accelerator(cpu=True, fsdp_plugin=...)` take the FSDP path.

    Call after `torch.distributed.init_process_group` and before building the Accelerator.
    """
    import torch.distributed as dist
    from accelerate import PartialState
    from accelerate.utils import DistributedType

    _check_accelerate_version()
    if not dist.is_initialized():
        raise RuntimeError("enable_fsdp_on_cpu: initialise the process group first")
    state = PartialState(cpu=True)
    if state.distributed_type not in (DistributedType.MULTI_CPU, DistributedType.MULTI_GPU):
        raise RuntimeError(f"enable_fsdp_on_cpu: unexpected distributed type {state.distributed_type}")
    state.distributed_type = DistributedType.MULTI_GPU


def unpinned_cpu_offload() -> None:
    """Make `torch.distributed.fsdp.CPUOffloadPolicy()` default to unpinned memory (see above)."""
    import dataclasses

    import torch.distributed.fsdp as fsdp

    _check_accelerate_version()
    if getattr(fsdp.CPUOffloadPolicy, "_ckptdoctor_unpinned", False):
        return

    @dataclasses.dataclass
    class CPUOffloadPolicy(fsdp.CPUOffloadPolicy):
        pin_memory: bool = False
        _ckptdoctor_unpinned = True

    fsdp.CPUOffloadPolicy = CPUOffloadPolicy

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

The third helper puts FSDP's collectives on their own group. In the reporter's job the
default group is "cpu:gloo,npu:hccl": FSDP's all-gathers and reduce-scatters run on HCCL,
while DCP's object collectives run on gloo. On CPU both would share one gloo group, so the
gloo deadline under study would also govern training; a separate group keeps them apart
exactly as HCCL and gloo are apart on NPU.
"""

from __future__ import annotations

from ..errors import UnsupportedVersion

SUPPORTED_ACCELERATE = ("1.13.0", "1.15.0")


def _check_accelerate_version() -> None:
    from ..fix.compat import installed_versions

    version = installed_versions()[1]
    if version not in SUPPORTED_ACCELERATE:
        raise UnsupportedVersion(
            f"accelerate {version} is not supported by the CPU FSDP shim (checked: {', '.join(SUPPORTED_ACCELERATE)})")


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


def use_training_group(accelerator, group) -> None:
    """Give FSDP a 1-D mesh over `group` instead of the default group.

    Accelerate's FSDP2 prepare shards over `accelerator.torch_device_mesh[fsdp_dim_names]`;
    with only data-parallel sharding that is the one dimension "dp_shard_cp".
    """
    from torch.distributed.device_mesh import DeviceMesh

    names = tuple(accelerator.parallelism_config.fsdp_dim_names)
    if names != ("dp_shard_cp",):
        raise NotImplementedError(f"a separate training group supports pure FSDP meshes only, not {names}")
    accelerator.state.device_mesh = DeviceMesh.from_group(group, "cpu", mesh_dim_names=names)

"""FSDP's collectives on their own group, in the lab.

In the reporter's job the default group is "cpu:gloo,npu:hccl": FSDP's all-gathers and
reduce-scatters run on HCCL, while DCP's object collectives run on gloo. On CPU both would
share one gloo group, so the gloo deadline under study would also govern training; a separate
group keeps them apart exactly as HCCL and gloo are apart on NPU.
"""

from __future__ import annotations


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

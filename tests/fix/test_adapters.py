"""LoRA adapters without a full-model gather (fix/adapters.py), on a one-rank gloo group."""

import pytest
import torch

from ckptdoctor.errors import CkptDoctorError
from ckptdoctor.fix.adapters import adapter_state_dict


def test_adapter_state_dict_gathers_sharded_adapters_and_copies_plain_ones(tmp_path):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        model = torch.nn.Module()
        model.lora_A = torch.nn.Parameter(distribute_tensor(torch.arange(6.0).reshape(3, 2), mesh, [Shard(0)]))
        model.lora_B = torch.nn.Parameter(torch.arange(4.0))
        model.base = torch.nn.Parameter(torch.ones(2))
        state = adapter_state_dict(model)
        assert list(state) == ["lora_A", "lora_B"]
        assert type(state["lora_A"]) is torch.Tensor and torch.equal(state["lora_A"], torch.arange(6.0).reshape(3, 2))
        assert state["lora_B"].data_ptr() != model.lora_B.data_ptr()  # a copy, safe from the next step
        with pytest.raises(CkptDoctorError, match="no parameter name contains"):
            adapter_state_dict(torch.nn.Linear(2, 2))
    finally:
        dist.destroy_process_group()

import pytest
from torch.distributed.fsdp import CPUOffloadPolicy, FullOptimStateDictConfig, FullStateDictConfig

from ckptdoctor.errors import BadLayout
from ckptdoctor.repro.config import TrainingConfig, fsdp_plugin_kwargs, parallelism_kwargs


def test_plugin_kwargs_carry_movas_choices():
    kwargs = fsdp_plugin_kwargs(TrainingConfig(), ignored_modules=["x"])
    assert kwargs["fsdp_version"] == 2
    assert kwargs["state_dict_type"] == "SHARDED_STATE_DICT"
    assert isinstance(kwargs["state_dict_config"], FullStateDictConfig) and kwargs["state_dict_config"].offload_to_cpu
    assert isinstance(kwargs["optim_state_dict_config"], FullOptimStateDictConfig)
    assert kwargs["transformer_cls_names_to_wrap"] == ["DiTBlock", "ConditionalCrossAttentionBlock"]
    assert kwargs["ignored_modules"] == ["x"]
    policy = kwargs["cpu_offload"]
    assert isinstance(policy, CPUOffloadPolicy) and policy.pin_memory is False


def test_offload_off_and_plugin_accepts_the_kwargs():
    from accelerate import FullyShardedDataParallelPlugin

    assert fsdp_plugin_kwargs(TrainingConfig(offload_params=False), None)["cpu_offload"] is False
    plugin = FullyShardedDataParallelPlugin(**fsdp_plugin_kwargs(TrainingConfig(), None))
    assert plugin.fsdp_version == 2 and plugin.state_dict_type.name == "SHARDED_STATE_DICT"
    assert plugin.state_dict_config.offload_to_cpu is True


def test_parallelism_folds_context_parallel_into_the_shard_group():
    assert parallelism_kwargs(TrainingConfig(world_size=8, cp_size=4)) == dict(
        dp_replicate_size=1, dp_shard_size=2, cp_size=4, tp_size=1)


@pytest.mark.parametrize("kwargs, message", [
    (dict(world_size=0), "at least 1"),
    (dict(world_size=6, cp_size=4), "cannot hold context-parallel size 4"),
    (dict(mode="qlora"), "unknown mode"),
])
def test_bad_layouts_are_clear_errors(kwargs, message):
    with pytest.raises(BadLayout, match=message):
        TrainingConfig(**kwargs)

"""The reporter's training configuration, and its translation into Accelerate objects.

Values come from MOVA's NPU branch as FACTS.md records them: the accelerate config file
(FSDP2, SHARDED_STATE_DICT, params offloaded, transformer wrap on the block classes, bf16,
a parallelism config) and the trainer's own plugin arguments (FullStateDictConfig /
FullOptimStateDictConfig with offload_to_cpu, as MOVA passes them).
"""

from __future__ import annotations

import dataclasses

from ..errors import BadLayout

WRAP_CLASSES = ("DiTBlock", "ConditionalCrossAttentionBlock")
# The checkpoint group's timeout relative to the training deadline. docs/fix-for-mova.md
# recommends 3 h for saves beside the 30 min default: the reproduction scales both alike.
CHECKPOINT_TIMEOUT_FACTOR = 6.0


@dataclasses.dataclass(frozen=True)
class TrainingConfig:
    world_size: int = 8
    mode: str = "sft"                 # "sft" (full fine-tuning) or "lora"
    cp_size: int = 1                  # the user's file says 4; context parallel is not run on CPU (see docs)
    offload_params: bool = True       # fsdp_offload_params
    reshard_after_forward: bool = True  # the trainer's plugin argument (the yaml says false; the plugin wins)
    mixed_precision: str = "bf16"
    lora_rank: int = 16
    learning_rate: float = 1e-4
    gradient_accumulation_steps: int = 4
    save_interval: int = 1            # optimizer steps between saves (200 in MOVA; 1 here)
    max_steps: int = 1
    micro_batch: int = 2
    seed: int = 1234

    def __post_init__(self):
        if self.mode not in ("sft", "lora"):
            raise BadLayout(f"unknown mode {self.mode!r}; expected 'sft' or 'lora'")
        if self.world_size < 1:
            raise BadLayout(f"world size must be at least 1, got {self.world_size}")
        if self.cp_size < 1 or self.world_size % self.cp_size:
            raise BadLayout(f"world size {self.world_size} cannot hold context-parallel size {self.cp_size} "
                            f"(it must divide the world size)")

    @property
    def dp_shard_size(self) -> int:
        return self.world_size // self.cp_size


def fsdp_plugin_kwargs(config: TrainingConfig, ignored_modules) -> dict:
    """Keyword arguments for `FullyShardedDataParallelPlugin`, as MOVA's trainer builds them."""
    from torch.distributed.fsdp import CPUOffloadPolicy, FullOptimStateDictConfig, FullStateDictConfig

    return dict(
        fsdp_version=2,
        state_dict_type="SHARDED_STATE_DICT",
        state_dict_config=FullStateDictConfig(offload_to_cpu=True),
        optim_state_dict_config=FullOptimStateDictConfig(offload_to_cpu=True),
        # `fsdp_offload_params: true` becomes CPUOffloadPolicy(); its default pin_memory=True
        # needs an accelerator ("CPU device type not an accelerator"), so CPU runs unpinned.
        cpu_offload=CPUOffloadPolicy(pin_memory=False) if config.offload_params else False,
        reshard_after_forward=config.reshard_after_forward,
        auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=list(WRAP_CLASSES),
        ignored_modules=ignored_modules,
    )


def parallelism_kwargs(config: TrainingConfig) -> dict:
    """Keyword arguments for `ParallelismConfig` (dp_replicate 1, tp 1, as in the user's file)."""
    return dict(dp_replicate_size=1, dp_shard_size=config.dp_shard_size, cp_size=config.cp_size, tp_size=1)

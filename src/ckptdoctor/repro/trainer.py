"""A trainer that follows MOVA's call path into `accelerator.save_state()`.

main -> train() -> _save_checkpoint() -> wait_for_everyone -> (LoRA) gather the adapter
weights -> rank 0 writes trainer state -> wait_for_everyone ->
accelerator.save_state(step_dir/"accelerator") -> save_fsdp_model, save_fsdp_optimizer ->
dist_cp.save. Written for this project from MOVA's structure as FACTS.md describes it.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import torch
import torch.distributed as dist

from ..selftest.accelerate_cpu import enable_fsdp_on_cpu
from .training_group import use_training_group
from .config import TrainingConfig, fsdp_plugin_kwargs, parallelism_kwargs
from ..check.mova_model import build_model
from ..check.mova_shape import MovaShape


@dataclasses.dataclass
class TrainResult:
    losses: list[float]
    saved_steps: list[int]


class AccelerateTrainer:
    """Owns the Accelerator, the FSDP2 model and AdamW; trains and checkpoints like MOVA."""

    def __init__(self, config: TrainingConfig, shape: MovaShape, output_dir: str | os.PathLike,
                 training_group=None, save_hook=None):
        from accelerate import Accelerator, FullyShardedDataParallelPlugin, ParallelismConfig

        self.config, self.shape, self.output_dir = config, shape, Path(output_dir)
        self.training_group = training_group
        self.save_hook = save_hook  # called around save_state by ckptdoctor's fix and watchdog
        model, ignored = build_model(shape, config.mode, config.lora_rank, seed=config.seed)
        enable_fsdp_on_cpu()
        self.accelerator = Accelerator(
            cpu=True,
            mixed_precision=config.mixed_precision,
            gradient_accumulation_steps=config.gradient_accumulation_steps,
            fsdp_plugin=FullyShardedDataParallelPlugin(**fsdp_plugin_kwargs(config, ignored)),
            parallelism_config=ParallelismConfig(**parallelism_kwargs(config)),
        )
        if training_group is not None:
            use_training_group(self.accelerator, training_group)
        trainable = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(trainable, lr=config.learning_rate)
        self.model, self.optimizer = self.accelerator.prepare(model, optimizer)
        self.step = 0

    # -- data -------------------------------------------------------------------------
    def batch(self, micro_step: int):
        """A deterministic synthetic batch for this rank: one high- and one low-noise sample."""
        s, n = self.shape, self.config.micro_batch
        gen = torch.Generator().manual_seed(self.config.seed * 1_000_003 + micro_step * 1009 + self.accelerator.process_index)
        video = torch.randn(n, 6, 3, generator=gen)
        audio = torch.randn(n, 5, 2, generator=gen)
        text_ids = torch.randint(0, s.vocab, (n, 4), generator=gen)
        t = torch.rand(n, generator=gen) * 0.5 + 0.5 * (torch.arange(n) % 2 == 0)
        torch.manual_seed(micro_step * 7919 + self.accelerator.process_index)  # the noise draws
        return video, audio, text_ids, t

    # -- training ---------------------------------------------------------------------
    def train(self) -> TrainResult:
        result = TrainResult(losses=[], saved_steps=[])
        micro = self.step * self.config.gradient_accumulation_steps
        while self.step < self.config.max_steps:
            total = 0.0
            for _ in range(self.config.gradient_accumulation_steps):
                with self.accelerator.accumulate(self.model):
                    loss = self.model(*self.batch(micro))
                    self.accelerator.backward(loss)
                    if self.accelerator.sync_gradients:
                        self._average_ignored_grads()
                    self.optimizer.step()
                    self.optimizer.zero_grad()
                total += loss.detach().float().item()
                micro += 1
            self.step += 1
            result.losses.append(total / self.config.gradient_accumulation_steps)
            if self.step % self.config.save_interval == 0:
                self._align_ranks()
                self._save_checkpoint()
                result.saved_steps.append(self.step)
        return result

    def _average_ignored_grads(self) -> None:
        """FSDP does not reduce ignored parameters (the LoRA adapters): average them here,
        on the training group, so every rank's replica stays identical."""
        for param in self.model.parameters():
            if param.grad is not None and not hasattr(param, "placements"):
                dist.all_reduce(param.grad, group=self.training_group)
                param.grad /= self.accelerator.num_processes

    def _align_ranks(self) -> None:
        """The ranks meet on the training group before the save: how far apart they finish the
        optimizer step on shared cores is training, not the deadline's (mova/rank.py,
        training_group_for_fsdp_and_movas_saves, says more)."""
        if self.training_group is not None:
            dist.barrier(group=self.training_group)

    # -- checkpointing ----------------------------------------------------------------
    def step_dir(self, step: int) -> Path:
        return self.output_dir / f"step-{step}"

    def _save_checkpoint(self) -> Path:
        step_dir = self.step_dir(self.step)
        self.accelerator.wait_for_everyone()
        if self.config.mode == "lora":
            self._save_lora_weights(step_dir)
        if self.accelerator.is_main_process:
            step_dir.mkdir(parents=True, exist_ok=True)
            torch.save({"step": self.step, "config": dataclasses.asdict(self.config)}, step_dir / "trainer_state.pt")
        self.accelerator.wait_for_everyone()
        if self.save_hook is not None:
            self.save_hook(self, step_dir / "accelerator")
        else:
            self.accelerator.save_state(str(step_dir / "accelerator"))
        return step_dir

    def _save_lora_weights(self, step_dir: Path) -> None:
        """MOVA gathers the full model state dict (FSDP2: full, offloaded to rank 0's CPU)
        only to pick out the adapter weights."""
        if getattr(self.save_hook, "local_adapters", False):  # the fix: no gather of the full model
            from ..fix.adapters import adapter_state_dict
            adapters = adapter_state_dict(self.model)
        else:
            adapters = {k: v for k, v in self.accelerator.get_state_dict(self.model).items() if "lora_" in k}
        if self.accelerator.is_main_process:
            step_dir.mkdir(parents=True, exist_ok=True)
            torch.save(adapters, step_dir / "lora_weights.pt")

    def load_checkpoint(self, step: int) -> None:
        self.accelerator.load_state(str(self.step_dir(step) / "accelerator"))
        self.step = step

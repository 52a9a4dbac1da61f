"""A tiny MOVA pipeline and dataset for MOVA's own trainer, registered in MOVA's registries.

MOVA's `AccelerateTrainer` calls these on the model it is given: `freeze_for_training`,
`get_trainable_parameters`, `save_trainable_weights`, `forward(video=, audio=, first_frame=,
caption=, global_step=, cp_mesh=)` returning `loss`, `video_loss` and `audio_loss`, and the
`text_encoder` / `video_vae` / `audio_vae` attributes it passes to FSDP as ignored modules;
`accelerate_train.py` calls `scheduler.set_timesteps(...)`. The pipeline has them, with MOVA's
semantics (`MOVATrain` in mova/diffusion/pipelines/mova_train.py), over ckptdoctor's
MOVA-shaped model (check/mova_model.py: two video DiT towers, an audio tower, the bridge), whose
block classes carry MOVA's names (`DiTBlock`, `ConditionalCrossAttentionBlock`) for the
accelerate config's transformer wrap. The scheduler is MOVA's own `FlowMatchScheduler`.

Importing this module needs MOVA on the path (the harness's rank entry puts it there).
"""

from __future__ import annotations

import os
import zlib

import torch
from mova.diffusion.schedulers.flow_match import FlowMatchScheduler
from mova.engine.utils.base_pipeline import BasePipeline
from mova.registry import DATASETS, DIFFUSION_PIPELINES
from torch.utils.data import Dataset

from ...check.mova_model import MOVA
from ...check.mova_shape import MovaShape

TRAIN_MODULES = ["video_dit", "video_dit_2", "audio_dit", "dual_tower_bridge"]


@DIFFUSION_PIPELINES.register_module()
class TinyMOVATrain(BasePipeline):
    """MOVA's training pipeline interface on the MOVA-shaped model."""

    last_losses: list[float] = []
    rng_digests: list[int] = []  # CRC-32 of torch's RNG state at each forward

    def __init__(self, video_layers: int = 2, device: str = "cpu", torch_dtype=torch.bfloat16, seed: int = 1234,
                 use_gradient_checkpointing: bool = False, use_gradient_checkpointing_offload: bool = False):
        super().__init__()
        torch.manual_seed(seed)
        model = MOVA(MovaShape().with_layers(video_layers)).to(dtype=torch_dtype)
        for name in TRAIN_MODULES + ["text_encoder", "video_vae", "audio_vae"]:
            setattr(self, name, getattr(model, name))
        self._model = [model]  # its forward, without registering it twice as a submodule
        self.scheduler = FlowMatchScheduler()
        self.losses: list[float] = []  # what this rank saw, step by step (the harness reports it)
        TinyMOVATrain.last_losses = self.losses

    def freeze_for_training(self, train_modules=None):
        for _, module in self.named_children():
            module.eval()
            module.requires_grad_(False)
        for name in train_modules or TRAIN_MODULES:
            getattr(self, name).train()
            getattr(self, name).requires_grad_(True)

    def get_trainable_parameters(self, train_modules=None):
        return [p for name in train_modules or TRAIN_MODULES for p in getattr(self, name).parameters()]

    def save_trainable_weights(self, save_path, train_modules=None):
        """As MOVA's: every rank writes each trainable module's state dict."""
        for name in train_modules or TRAIN_MODULES:
            module_path = os.path.join(save_path, name)
            os.makedirs(module_path, exist_ok=True)
            torch.save(getattr(self, name).state_dict(), os.path.join(module_path, "pytorch_model.bin"))

    def forward(self, video, audio, first_frame, caption, global_step=0, cp_mesh=None, **kwargs):
        TinyMOVATrain.rng_digests.append(zlib.crc32(torch.get_rng_state().numpy().tobytes()))
        index = torch.randint(0, len(self.scheduler.timesteps), (video.shape[0],))
        t = self.scheduler.timesteps[index].float() / self.scheduler.num_train_timesteps
        text_ids = torch.tensor([[ord(c) % self._model[0].shape.vocab for c in text[:4].ljust(4)] for text in caption])
        loss = self._model[0](video.flatten(2)[..., :3].float(), audio.transpose(1, 2)[..., :2].float(), text_ids, t)
        self.losses.append(float(loss.detach()))
        return {"loss": loss, "video_loss": loss.detach(), "audio_loss": loss.detach() * 0}


@DATASETS.register_module()
class TinyVideoAudioDataset(Dataset):
    """`length` copies of one sample in MOVA's item format (video, audio, first_frame, caption,
    idx). Every sample is the same: MOVA restarts its data iterator on resume, and this keeps what
    the model sees independent of where that iterator stands."""

    def __init__(self, length: int = 32, frames: int = 6, transform=None, **kwargs):
        gen = torch.Generator().manual_seed(7)
        self.length = length
        self.item = {"video": torch.randn(frames, 3, 1, 1, generator=gen),  # [T, C, H, W]
                     "audio": torch.randn(2, 10, generator=gen),  # [channels, samples]: the audio tower's 2 inputs
                     "first_frame": torch.randn(3, 1, 1, generator=gen), "caption": "a cat plays the piano"}

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, idx: int) -> dict:
        return dict(self.item, idx=idx)

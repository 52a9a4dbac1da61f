"""A MOVA-shaped model, small enough for a self-test: a video tower of DiT-like blocks, an
audio tower of half the width and half the blocks, a bridge between them. Names and nesting
follow MOVA's (`video_dit.blocks.N...`), so the checkpoint has the same kinds of keys: many
2-D weights sharded by FSDP, 1-D norms and biases, and AdamW state for each.

Not check/mova_model.py, which is MOVA's whole parameter structure (every tower, the frozen
encoders FSDP ignores, LoRA), built to predict planning cost and trained by the lab: this one is
a few blocks that train and round-trip in seconds on the user's cluster, on its own device."""

from __future__ import annotations

import torch
from torch import nn


class SelftestBlock(nn.Module):
    """One transformer-like block (FSDP wraps each one, as MOVA's DiTBlock)."""

    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.mlp_in = nn.Linear(width, 4 * width)
        self.mlp_out = nn.Linear(4 * width, width)

    def forward(self, x):
        q, k, v = self.qkv(self.norm(x)).chunk(3, dim=-1)
        attention = torch.softmax(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5, dim=-1)
        x = x + self.proj(attention @ v)
        return x + self.mlp_out(torch.nn.functional.gelu(self.mlp_in(x)))


class Tower(nn.Module):
    def __init__(self, width: int, layers: int):
        super().__init__()
        self.blocks = nn.ModuleList(SelftestBlock(width) for _ in range(layers))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


class MovaShapedModel(nn.Module):
    def __init__(self, width: int = 256, layers: int = 4):
        super().__init__()
        self.video_dit = Tower(width, layers)
        self.audio_dit = Tower(width // 2, max(1, layers // 2))
        self.bridge = nn.Linear(width // 2, width)

    def forward(self, video, audio):
        return self.video_dit(video + self.bridge(self.audio_dit(audio))).float().pow(2).mean()


def batch(width: int, seed: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """A deterministic batch for one rank and step."""
    generator = torch.Generator().manual_seed(seed)
    video = torch.randn(2, 16, width, generator=generator)
    audio = torch.randn(2, 16, width // 2, generator=generator)
    return video.to(device), audio.to(device)

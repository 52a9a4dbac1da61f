"""A MOVA-shaped model: the parameter structure of MOVA, not its weights or its maths.

What matters for checkpoint planning is the number, names and shapes of the tensors, and
which of them FSDP2 shards (DTensors) or leaves alone (ignored, plain replicated tensors).
So the model keeps MOVA's structure (FACTS.md, "Model shape"): two video DiT towers, an
audio DiT tower, a dual-tower bridge of conditional cross-attention blocks, and a frozen
text encoder and VAEs that FSDP ignores. Widths are tiny by default; layer counts go up to
the real ones, because the tensor count, not the width, drives planning cost.

(selftest/model.py is another, much smaller model: a few blocks the self-test trains on the
cluster's own device. This one is what `check` plans and the lab's look-alike trainer trains.)
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from .mova_shape import MovaShape

LORA_TARGETS = ("q", "k", "v", "o", "to_q", "to_k", "to_v", "proj")
TENSORS_PER_DIT_BLOCK = 27


class RMSNorm(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


def _attend(q, k, v, heads: int):
    b, lq, d = q.shape
    split = lambda t: t.view(b, t.shape[1], heads, d // heads).transpose(1, 2)  # noqa: E731
    out = F.scaled_dot_product_attention(split(q), split(k), split(v))
    return out.transpose(1, 2).reshape(b, lq, d)


class Attention(nn.Module):
    """Self- or cross-attention with q,k,v,o projections (with bias) and RMS q/k norms."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))
        self.norm_q, self.norm_k = RMSNorm(dim), RMSNorm(dim)

    def forward(self, x, context=None):
        context = x if context is None else context
        q, k = self.norm_q(self.q(x)), self.norm_k(self.k(context))
        return self.o(_attend(q, k, self.v(context), self.heads))


class DiTBlock(nn.Module):
    """A Wan-style block: 27 tensors, the structure FACTS.md lists."""

    def __init__(self, dim: int, ffn: int, heads: int):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, elementwise_affine=False)
        self.self_attn = Attention(dim, heads)
        self.norm3 = nn.LayerNorm(dim)
        self.cross_attn = Attention(dim, heads)
        self.norm2 = nn.LayerNorm(dim, elementwise_affine=False)
        self.ffn = nn.Sequential(nn.Linear(dim, ffn), nn.GELU(approximate="tanh"), nn.Linear(ffn, dim))
        self.modulation = nn.Parameter(torch.randn(1, 6, dim) / math.sqrt(dim))

    def forward(self, x, context, t_mod):
        shift1, scale1, gate1, shift2, scale2, gate2 = (self.modulation + t_mod).chunk(6, dim=1)
        x = x + gate1 * self.self_attn(self.norm1(x) * (1 + scale1) + shift1)
        x = x + self.cross_attn(self.norm3(x), context)
        return x + gate2 * self.ffn(self.norm2(x) * (1 + scale2) + shift2)


class DiTTower(nn.Module):
    """Patch, text and time embeddings, a stack of DiT blocks and an output head."""

    def __init__(self, dim: int, ffn: int, layers: int, shape: MovaShape):
        super().__init__()
        self.freq_dim = shape.freq_dim
        self.patch_embedding = nn.Linear(shape.latent_channels, dim)
        self.text_embedding = nn.Sequential(nn.Linear(shape.text_dim, dim), nn.GELU(approximate="tanh"),
                                            nn.Linear(dim, dim))
        self.time_embedding = nn.Sequential(nn.Linear(shape.freq_dim, dim), nn.SiLU(), nn.Linear(dim, dim))
        self.time_projection = nn.Sequential(nn.SiLU(), nn.Linear(dim, 6 * dim))
        self.blocks = nn.ModuleList(DiTBlock(dim, ffn, shape.heads) for _ in range(layers))
        self.head_norm = nn.LayerNorm(dim, elementwise_affine=False)
        self.head = nn.Linear(dim, shape.latent_channels)

    def embed(self, latents, text, t):
        # Under FSDP2 mixed precision the tower computes in its (bf16) parameter dtype,
        # while the ignored frozen encoders stay fp32: cast at the boundary.
        dtype = self.patch_embedding.weight.dtype
        latents, text = latents.to(dtype), text.to(dtype)
        half = self.freq_dim // 2
        freqs = torch.exp(-math.log(10000) * torch.arange(half, dtype=torch.float32) / half)
        angles = t.float()[:, None] * freqs[None]
        t_emb = self.time_embedding(torch.cat([angles.cos(), angles.sin()], dim=-1).to(dtype))
        t_mod = self.time_projection(t_emb).unflatten(1, (6, -1))
        return self.patch_embedding(latents), self.text_embedding(text), t_mod

    def unembed(self, x):
        return self.head(self.head_norm(x))


class ConditionalCrossAttentionBlock(nn.Module):
    """A bridge block: one tower's tokens attend to the other's (to_q/to_k/to_v/proj)."""

    def __init__(self, dim: int, cond_dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm = nn.LayerNorm(dim)
        self.to_q, self.to_k, self.to_v = nn.Linear(dim, dim), nn.Linear(cond_dim, dim), nn.Linear(cond_dim, dim)
        self.norm_q, self.norm_k = RMSNorm(dim), RMSNorm(dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x, cond):
        q, k = self.norm_q(self.to_q(self.norm(x))), self.norm_k(self.to_k(cond))
        return x + self.proj(_attend(q, k, self.to_v(cond), self.heads))


class DualTowerBridge(nn.Module):
    def __init__(self, shape: MovaShape):
        super().__init__()
        self.audio_to_video = nn.ModuleList(
            ConditionalCrossAttentionBlock(shape.video_dim, shape.audio_dim, shape.heads)
            for _ in range(shape.bridge_layers))
        self.video_to_audio = nn.ModuleList(
            ConditionalCrossAttentionBlock(shape.audio_dim, shape.video_dim, shape.heads)
            for _ in range(shape.bridge_layers))


class TextEncoder(nn.Module):
    """Frozen; FSDP ignores it (plain tensors on every rank)."""

    def __init__(self, shape: MovaShape):
        super().__init__()
        self.token_embedding = nn.Embedding(shape.vocab, shape.text_dim)
        self.layers = nn.ModuleList(nn.Linear(shape.text_dim, shape.text_dim) for _ in range(shape.text_layers))
        self.final_norm = nn.LayerNorm(shape.text_dim)

    def forward(self, ids):
        x = self.token_embedding(ids)
        for layer in self.layers:
            x = x + torch.tanh(layer(x))
        return self.final_norm(x)


class LatentVAE(nn.Module):
    """Frozen stand-in for a VAE: only its encoder is used in training."""

    def __init__(self, in_channels: int, latent_channels: int):
        super().__init__()
        self.encoder = nn.Linear(in_channels, latent_channels)
        self.decoder = nn.Linear(latent_channels, in_channels)

    def encode(self, x):
        return self.encoder(x)


class MOVA(nn.Module):
    """Two video experts (high/low noise), an audio tower and the bridge, plus frozen parts."""

    BOUNDARY = 0.5  # timesteps above it go to video_dit (high noise), below to video_dit_2

    def __init__(self, shape: MovaShape = MovaShape()):
        super().__init__()
        self.shape = shape
        self.text_encoder = TextEncoder(shape)
        self.video_vae = LatentVAE(3, shape.latent_channels)
        self.audio_vae = LatentVAE(2, shape.latent_channels)
        self.video_dit = DiTTower(shape.video_dim, shape.video_ffn, shape.video_layers, shape)
        self.video_dit_2 = DiTTower(shape.video_dim, shape.video_ffn, shape.video_layers, shape)
        self.audio_dit = DiTTower(shape.audio_dim, shape.audio_ffn, shape.audio_layers, shape)
        self.dual_tower_bridge = DualTowerBridge(shape)

    def frozen_modules(self) -> list[nn.Module]:
        return [self.text_encoder, self.video_vae, self.audio_vae]

    def trainable_towers(self) -> list[nn.Module]:
        return [self.video_dit, self.video_dit_2, self.audio_dit, self.dual_tower_bridge]

    def forward(self, video, audio, text_ids, t):
        """Flow-matching loss for one batch. Every tower runs on every call, so every
        rank issues the same FSDP collectives (an expert skipped on one rank would hang)."""
        frozen_dtype = self.video_vae.encoder.weight.dtype
        video, audio = video.to(frozen_dtype), audio.to(frozen_dtype)
        with torch.no_grad():
            text = self.text_encoder(text_ids)
            v0, a0 = self.video_vae.encode(video), self.audio_vae.encode(audio)
        loss = 0.0
        for expert, mask in ((self.video_dit, t >= self.BOUNDARY), (self.video_dit_2, t < self.BOUNDARY)):
            loss = loss + self._denoise_loss(expert, v0, a0, text, t, mask)
        return loss

    def _denoise_loss(self, video_tower, v0, a0, text, t, mask):
        tt = t[:, None, None]
        v_noise, a_noise = torch.randn_like(v0), torch.randn_like(a0)
        vx, v_ctx, v_mod = video_tower.embed((1 - tt) * v0 + tt * v_noise, text, t)
        ax, a_ctx, a_mod = self.audio_dit.embed((1 - tt) * a0 + tt * a_noise, text, t)
        bridge = self.dual_tower_bridge
        for i in range(max(len(video_tower.blocks), len(self.audio_dit.blocks))):
            if i < len(video_tower.blocks):
                vx = video_tower.blocks[i](vx, v_ctx, v_mod)
            if i < len(self.audio_dit.blocks):
                ax = self.audio_dit.blocks[i](ax, a_ctx, a_mod)
            if i < len(bridge.audio_to_video):
                vx, ax = bridge.audio_to_video[i](vx, ax), bridge.video_to_audio[i](ax, vx)
        v_err = (video_tower.unembed(vx).float() - (v_noise - v0)).pow(2).mean(dim=(1, 2))
        a_err = (self.audio_dit.unembed(ax).float() - (a_noise - a0)).pow(2).mean(dim=(1, 2))
        return ((v_err + a_err) * mask).sum() / mask.numel()


class LoRALinear(nn.Module):
    """A frozen base Linear plus a rank-r update (lora_B starts at zero)."""

    def __init__(self, base: nn.Linear, rank: int):
        super().__init__()
        self.base_layer = base
        self.lora_A = nn.Linear(base.in_features, rank, bias=False)
        self.lora_B = nn.Linear(rank, base.out_features, bias=False)
        nn.init.zeros_(self.lora_B.weight)

    def forward(self, x):
        out = self.base_layer(x)
        # The adapters are FSDP-ignored, so they keep fp32 while the base computes in bf16.
        return out + self.lora_B(self.lora_A(x.to(self.lora_A.weight.dtype))).to(out.dtype)


def inject_lora(model: MOVA, rank: int = 16, targets=LORA_TARGETS) -> list[nn.Module]:
    """Wrap every target Linear of the trainable towers; freeze everything else.

    Returns the LoRA modules (lora_A/lora_B), which MOVA passes to FSDP as ignored modules.
    """
    model.requires_grad_(False)
    lora_modules: list[nn.Module] = []
    for tower in model.trainable_towers():
        for parent in list(tower.modules()):
            for name, child in list(parent.named_children()):
                if name in targets and isinstance(child, nn.Linear):
                    wrapped = LoRALinear(child, rank)
                    setattr(parent, name, wrapped)
                    lora_modules += [wrapped.lora_A, wrapped.lora_B]
    for module in lora_modules:
        module.requires_grad_(True)
    return lora_modules


def build_model(shape: MovaShape, mode: str, lora_rank: int = 16, seed: int = 0) -> tuple[MOVA, list[nn.Module]]:
    """The model for `mode` ('sft' or 'lora') and the modules FSDP must ignore."""
    torch.manual_seed(seed)
    model = MOVA(shape)
    for module in model.frozen_modules():
        module.requires_grad_(False)
    ignored = list(model.frozen_modules())
    if mode == "lora":
        ignored += inject_lora(model, lora_rank)
    elif mode != "sft":
        raise ValueError(f"unknown training mode {mode!r} (expected 'sft' or 'lora')")
    return model, ignored


def tensor_counts(model: nn.Module) -> dict[str, int]:
    """Counts of parameter tensors: total, trainable, and per top-level child."""
    counts = {"total": 0, "trainable": 0}
    for name, param in model.named_parameters():
        counts["total"] += 1
        counts["trainable"] += int(param.requires_grad)
        top = name.split(".", 1)[0]
        counts[top] = counts.get(top, 0) + 1
    return counts

"""MOVA's widths and depths: what the cost model, the reproduction and the tests size a
MOVA-shaped model by (the model itself is `mova_model.py`). No torch here: the command line
and the cost model's parent process read a shape without importing torch."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class MovaShape:
    """Widths and depths. Defaults are tiny; :meth:`real` gives MOVA's (partly estimated)."""

    video_dim: int = 16
    video_ffn: int = 32
    video_layers: int = 2
    audio_dim: int = 8
    audio_ffn: int = 16
    audio_layers: int = 2
    bridge_layers: int = 1
    text_dim: int = 8
    text_layers: int = 1
    vocab: int = 64
    latent_channels: int = 4
    freq_dim: int = 8
    heads: int = 2

    @classmethod
    def real(cls) -> "MovaShape":
        # Video towers: Wan 14B (dim 5120, ffn 13824, 40 blocks), from FACTS.md.
        # Audio tower, bridge depth and text encoder are estimates (the released
        # configs are not available here); they only move the tensor count a little.
        return cls(video_dim=5120, video_ffn=13824, video_layers=40,
                   audio_dim=1536, audio_ffn=8960, audio_layers=30, bridge_layers=15,
                   text_dim=4096, text_layers=24, vocab=256384, latent_channels=16,
                   freq_dim=256, heads=40)

    def with_layers(self, video: int, audio: int | None = None, bridge: int | None = None) -> "MovaShape":
        return dataclasses.replace(self, video_layers=video,
                                   audio_layers=video if audio is None else audio,
                                   bridge_layers=max(1, video // 2) if bridge is None else bridge)

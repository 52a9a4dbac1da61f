"""Stand-in for audiotools.ml (see ../../README.md)."""

import torch


class BaseModel(torch.nn.Module):
    """The base class MOVA's DAC model derives from; the harness never builds that model."""

"""ckptdoctor: reproduce, explain and fix distributed-checkpoint hangs in FSDP2 + Accelerate.

The library API a trainer imports: `from ckptdoctor import ScalableSavePlanner`. Loaded on
first use, so that the CLI's log diagnosis does not import torch.
"""

__version__ = "0.1.0"
__all__ = ["ScalableSavePlanner"]


def __getattr__(name):
    if name == "ScalableSavePlanner":
        from .planner import ScalableSavePlanner

        return ScalableSavePlanner
    raise AttributeError(f"module 'ckptdoctor' has no attribute {name!r}")

"""ckptdoctor: reproduce, explain and fix distributed-checkpoint hangs in FSDP2 + Accelerate.

The library API a trainer imports: `from ckptdoctor import ScalableSavePlanner,
ScalableFileSystemWriter` (or `ScalableCheckpointing` for Accelerate). Loaded on first use,
so that the CLI's log diagnosis does not import torch.
"""

__version__ = "0.1.0"
__all__ = ["ScalableSavePlanner", "ScalableFileSystemWriter", "ScalableCheckpointing"]
_HOMES = {"ScalableSavePlanner": "planner", "ScalableFileSystemWriter": "storage", "ScalableCheckpointing": "checkpointing"}


def __getattr__(name):
    if name in _HOMES:
        import importlib

        return getattr(importlib.import_module(f".{_HOMES[name]}", __name__), name)
    raise AttributeError(f"module 'ckptdoctor' has no attribute {name!r}")

"""What Accelerate's `save_state` writes, by name: the one place the fix reads that layout.

In an Accelerate state directory, FSDP's model `i` is the DCP checkpoint `pytorch_model_fsdp_<i>/`
and optimizer `i` is `optimizer_<i>/` (`SHARDED_STATE_DICT`); rank 0's RNG states,
`random_states_0.pkl`, are written after them, so a stock save that has them and every DCP
checkpoint's `.metadata` is whole. A trainer may keep that directory inside a step directory of
its own (MOVA: `step-N/accelerator`). The prefixes are Accelerate's constants
(`accelerate.utils.constants`: `FSDP_MODEL_NAME`, `OPTIMIZER_NAME`, `RNG_STATE_NAME`), written
out here so that the fix imports no Accelerate for them; tests/fix/test_accelerate_layout.py
compares them with the installed Accelerate's.
"""

from __future__ import annotations

from pathlib import Path

MODEL_PREFIX = "pytorch_model_fsdp_"
OPTIMIZER_PREFIX = "optimizer_"
RANK0_RNG_STATES = "random_states_0.pkl"
STATE_SUBDIRECTORY = "accelerator"  # where a step directory keeps it (MOVA's name; Accelerate sets none)


def state_directory(path: Path) -> Path:
    """`path` itself when it holds a model checkpoint, else `path/accelerator`."""
    path = Path(path)
    return path if any(path.glob(MODEL_PREFIX + "*")) else path / STATE_SUBDIRECTORY


def dcp_directories(state: Path) -> list[Path]:
    """The model checkpoints, then the optimizer checkpoints, of a state directory, sorted."""
    state = Path(state)
    return sorted(state.glob(MODEL_PREFIX + "*")) + sorted(state.glob(OPTIMIZER_PREFIX + "*"))


def is_dcp_name(name: str) -> bool:
    """Named as Accelerate names a model or optimizer DCP checkpoint."""
    return name.startswith((MODEL_PREFIX, OPTIMIZER_PREFIX))

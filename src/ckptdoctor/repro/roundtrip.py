"""The fixed save in the reproduction's trainer, and the proof that it round-trips.

`FixedSave` replaces the trainer's `accelerator.save_state` call with
`ScalableCheckpointing.save_state`, then checks the round trip: it snapshots this rank's
model and optimizer state, saves, overwrites the live state with garbage, loads the
checkpoint back through `accelerator.load_state` and compares bit for bit.
"""

from __future__ import annotations

import torch

from ..fix.checkpointing import ScalableCheckpointing


def local_state(model, optimizer) -> dict[str, object]:
    """This rank's model and optimizer state, flattened, local shards cloned."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    flat: dict[str, object] = {}

    def visit(prefix, value):
        if isinstance(value, dict):
            for key, item in value.items():
                visit(f"{prefix}.{key}", item)
        elif isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                visit(f"{prefix}.{i}", item)
        elif isinstance(value, torch.Tensor):
            local = value.to_local() if hasattr(value, "to_local") else value
            flat[prefix] = local.detach().clone()
        else:
            flat[prefix] = value

    visit("model", get_model_state_dict(model))
    visit("optim", get_optimizer_state_dict(model, optimizer))
    return flat


def scramble(model, optimizer) -> None:
    """Overwrite every parameter and optimizer tensor, so a load that skips one shows."""
    with torch.no_grad():
        for param in model.parameters():
            local = param.to_local() if hasattr(param, "to_local") else param
            local.fill_(12345.0)
        for state in optimizer.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    (value.to_local() if hasattr(value, "to_local") else value).fill_(-7.0)


def differences(before: dict, after: dict) -> list[str]:
    diff = [k for k in before.keys() | after.keys() if k not in before or k not in after]
    for key in before.keys() & after.keys():
        a, b = before[key], after[key]
        same = (a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)) if isinstance(a, torch.Tensor) \
            else a == b
        if not same:
            diff.append(key)
    return sorted(diff)


class FixedSave:
    """The trainer's save hook with the fix; records the round trip's outcome."""

    local_adapters = True  # LoRA weights gathered adapter by adapter (adapter_state_dict), not the whole model

    def __init__(self, checkpoint_timeout_s: float, roundtrip: bool = True):
        self.timeout_s = checkpoint_timeout_s
        self.roundtrip = roundtrip
        self.checkpointing = None
        self.roundtrip_differences: list[str] | None = None

    def __call__(self, trainer, output_dir) -> None:
        if self.checkpointing is None:
            self.checkpointing = ScalableCheckpointing(trainer.accelerator, timeout_s=self.timeout_s)
        if not self.roundtrip:
            self.checkpointing.save_state(output_dir)
            return
        before = local_state(trainer.model, trainer.optimizer)
        path = self.checkpointing.save_state(output_dir)
        scramble(trainer.model, trainer.optimizer)
        self.checkpointing.load_state(path)
        self.roundtrip_differences = differences(before, local_state(trainer.model, trainer.optimizer))

"""LoRA weights without a full-model gather."""

from __future__ import annotations

from ..errors import CkptDoctorError


def adapter_state_dict(model, marker: str = "lora_") -> dict:
    """The adapter (LoRA) weights, full, on every rank, without gathering the rest of the model.

    Call on every rank (sharded adapters are all-gathered, one tensor at a time, in parameter
    order). FSDP-sharded parameters (DTensors) are gathered; plain ones (FSDP-ignored) are this
    rank's copy: nothing in FSDP keeps those equal across ranks unless the trainer averages
    their gradients itself (check with `verify_replicas`). Keys are the model's parameter
    names, as in `accelerator.get_state_dict(model)`."""
    state = {}
    for name, param in model.named_parameters():
        if marker in name:
            full = param.full_tensor() if hasattr(param, "full_tensor") else param
            state[name] = full.detach().cpu().clone()
    if not state:
        raise CkptDoctorError(f"no parameter name contains {marker!r}")
    return state

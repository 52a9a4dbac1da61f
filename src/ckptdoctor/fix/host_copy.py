"""The host copy an async save writes from: one set of buffers per checkpoint, reused every save.

Accelerate's save_state makes two DCP checkpoints (the model's, the optimizer's). Each is staged
here under its name (its directory relative to the step, e.g. `pytorch_model_fsdp_0`): the first
time, host tensors of the same shapes are allocated with DCP's own `_create_cpu_state_dict`; every
later save copies into the same tensors with DCP's `_copy_state_dict` (what DCP's
`BlockingAsyncStager(cache_staged_state_dict=True)` does for one state dict). Values that are not
tensors (learning rates, step counts kept as numbers) are taken fresh at each save. A state whose
tensors changed shape, dtype or names (an optimizer's state appears after its first step) gets
new buffers and the old ones are dropped: at most one copy of each checkpoint is held.

Pinned memory (faster device-to-host copies) only where CUDA is available: DCP pins through
CUDA's host registration, which torch_npu does not provide, so on Ascend NPUs the copy is
plain host memory (MOVA offloads its parameters and optimizer state to the host anyway, so its
copy is host to host). `bytes` says how much is held (the INFO line reports it).
"""

from __future__ import annotations


class HostCopies:
    def __init__(self):
        self._copies: dict[str, tuple[tuple, dict]] = {}  # name -> (layout, the staged state dict)

    def stage(self, name: str, state_dict: dict) -> dict:
        """Every rank, on the training thread: `state_dict` copied into `name`'s buffers."""
        import torch
        from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict

        shape = layout(state_dict)
        held = self._copies.get(name)
        if held is None or held[0] != shape:
            self._copies.pop(name, None)  # the old buffers go before the new ones are made
            self._copies[name] = shape, _create_cpu_state_dict(state_dict, pin_memory=torch.cuda.is_available())
        return _copy_state_dict(state_dict, self._copies[name][1], type_check=False)

    def tensors(self, name: str) -> int:
        return len(self._copies[name][0]) if name in self._copies else 0

    @property
    def bytes(self) -> int:
        return sum(size for shape, _ in self._copies.values() for *_, size in shape)


def layout(state_dict: dict) -> tuple:
    """(key path, class, shape, dtype, bytes) of every tensor: equal layouts reuse buffers."""
    found = []

    def walk(value, path):
        if hasattr(value, "to_local") or hasattr(value, "local_shards") or hasattr(value, "untyped_storage"):
            local = value.to_local() if hasattr(value, "to_local") else value
            if hasattr(local, "local_shards"):
                sizes = [s.tensor.numel() * s.tensor.element_size() for s in local.local_shards()]
                found.append((path, type(value).__name__, tuple(value.size()), str(value.dtype), sum(sizes)))
            else:
                found.append((path, type(value).__name__, tuple(local.shape), str(local.dtype),
                              local.numel() * local.element_size()))
        elif isinstance(value, dict):
            for key, item in value.items():
                walk(item, (*path, str(key)))
        elif isinstance(value, (list, tuple)):
            for index, item in enumerate(value):
                walk(item, (*path, index))

    walk(state_dict, ())
    return tuple(found)

"""What one `dcp.save` receives, as meta tensors on any rank of a world of any size.

Two sources, one interface (`state_dict(save, layout, mesh)`, `sharded_shapes(save)`):
* `ParameterSpecs`: a model's parameters, saved as Accelerate's `save_fsdp_model` and
  `save_fsdp_optimizer` pass them (MOVA's by default: `mova_specs`);
* `CheckpointEntries`: every entry an existing DCP checkpoint's `.metadata` lists, so that
  any FSDP2 job can be predicted from a checkpoint it already wrote (`read_checkpoints`).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from ..errors import CkptDoctorError
from ..fix.index import METADATA_NAME
from ..fix.metadata_format import describe_format, newer_format_problem
from .layout import Layout

METADATA = METADATA_NAME  # DCP's file name, defined once (fix/index.py)


class ParameterSpecs(list):
    """(fqn, shape, sharded by FSDP, trainable) for every parameter of a model."""

    saves = ("model", "optimizer")

    def state_dict(self, save: str, layout: Layout, mesh) -> dict:
        """The state dict `dist_cp.save` receives, with meta DTensors for sharded tensors."""
        import torch

        def tensor(shape, sharded):
            return _meta_dtensor(shape, mesh, layout.placements()) if sharded else torch.empty(shape, device="meta")

        if save == "model":  # accelerate/utils/fsdp_utils.py: dist_cp.save(state_dict={"model": state_dict})
            return {"model": {name: tensor(shp, sharded) for name, shp, sharded, _ in self}}
        state = {name: {"step": torch.empty((), device="meta"), "exp_avg": tensor(shp, sharded),
                        "exp_avg_sq": tensor(shp, sharded)}
                 for name, shp, sharded, trainable in self if trainable}
        group = adamw_param_group_template() | {"params": list(state)}
        return {"optimizer": {"state": state, "param_groups": [group]}}

    def sharded_shapes(self, save: str) -> dict[tuple[int, ...], int]:
        """Sharded tensor shapes of the save and how many tensors have each."""
        classes: dict[tuple[int, ...], int] = {}
        for _, shp, sharded, trainable in self:
            if sharded and (save == "model" or trainable):
                classes[shp] = classes.get(shp, 0) + (1 if save == "model" else 2)  # exp_avg, exp_avg_sq
        return classes


def mova_specs(shape, mode: str) -> ParameterSpecs:
    """MOVA's parameters (`mova_model.MOVA` on the meta device) as MOVA's trainer shards them."""
    import torch

    from .mova_model import MOVA, inject_lora

    with torch.device("meta"):
        model = MOVA(shape)
        ignored = list(model.frozen_modules())
        if mode == "lora":
            ignored += inject_lora(model)
        else:
            for module in model.frozen_modules():
                module.requires_grad_(False)
    ignored_ids = {id(p) for m in ignored for p in m.parameters()}
    return ParameterSpecs((name, tuple(p.shape), id(p) not in ignored_ids, p.requires_grad)
                          for name, p in model.named_parameters())


def adamw_param_group_template() -> dict:
    """The non-`params` entries of an AdamW param group, from torch itself."""
    import torch

    group = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1e-4).state_dict()["param_groups"][0]
    return {k: v for k, v in group.items() if k != "params"}


def build_state_dict(save: str, specs, layout: Layout, mesh) -> dict:
    """What `dist_cp.save` receives for `save`, from either source."""
    return specs.state_dict(save, layout, mesh)


def _meta_dtensor(shape, mesh, placements, dtype=None):
    import torch
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local_shape, _ = compute_local_shape_and_global_offset(shape, mesh, placements)
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(torch.empty(local_shape, dtype=dtype, device="meta"), mesh, placements, run_check=False,
                              shape=torch.Size(shape), stride=stride)


# -- an existing checkpoint's entries ------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Entry:
    fqn: str
    size: tuple[int, ...] | None  # None: a Python value DCP pickles (a bytes item)
    dtype: str | None
    sharded: bool

    def torch_dtype(self):
        """The torch dtype the `.metadata` names ("torch.float32" -> torch.float32)."""
        import torch

        return getattr(torch, self.dtype.rpartition(".")[2])


class CheckpointEntries(list):
    """The entries of one DCP checkpoint, saved again at another world size: a tensor the
    checkpoint holds in more than one chunk was sharded, and FSDP2 shards it on dim 0 of the
    layout's mesh; a tensor in one whole chunk was replicated (ignored by FSDP), on every rank."""

    def state_dict(self, save: str, layout: Layout, mesh) -> dict:
        import torch

        def value(entry):
            if entry.size is None:
                return 0  # the value is pickled when written, never while planning
            dtype = entry.torch_dtype()
            if entry.sharded:
                return _meta_dtensor(entry.size, mesh, layout.placements(), dtype)
            return torch.empty(entry.size, dtype=dtype, device="meta")

        return {entry.fqn: value(entry) for entry in self}  # flat keys: DCP's flattening keeps them

    def sharded_shapes(self, save: str) -> dict[tuple[int, ...], int]:
        classes: dict[tuple[int, ...], int] = {}
        for entry in self:
            if entry.sharded:
                classes[entry.size] = classes.get(entry.size, 0) + 1
        return classes


def read_checkpoint_entries(directory: Path) -> tuple[CheckpointEntries, list[str]]:
    """(the entries `directory/.metadata` lists, notes on how they were read)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    try:
        metadata = FileSystemReader(str(directory)).read_metadata()
    except Exception as exc:  # noqa: BLE001 - any unreadable file is the same one-line answer
        newer = newer_format_problem(directory / METADATA, (directory / METADATA).read_bytes()) \
            if (directory / METADATA).is_file() else None
        raise CkptDoctorError(newer or f"cannot read {directory / METADATA}: {type(exc).__name__}: {exc}") from None
    tensors = {k: v for k, v in metadata.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}
    any_sharded = any(len(md.chunks) > 1 for md in tensors.values())
    entries = CheckpointEntries()
    for fqn, md in metadata.state_dict_metadata.items():
        if fqn not in tensors:
            entries.append(Entry(fqn, None, None, False))
            continue
        size = tuple(md.size)
        sharded = len(md.chunks) > 1 if any_sharded else len(size) > 0
        entries.append(Entry(fqn, size, str(md.properties.dtype), sharded))
    notes = [f"{directory}: {describe_format(metadata)}"] + ([] if any_sharded else [
        f"{directory}: no tensor is in more than one chunk (saved by one rank?): every tensor of one "
        f"dimension or more is taken as sharded by FSDP"])
    return entries, notes


def find_checkpoints(directory: str | Path) -> list[tuple[str, Path]]:
    """(name, path) of each DCP checkpoint: `directory` itself, or each of its subdirectories
    holding a `.metadata` (an Accelerate `save_state` directory holds one per model and optimizer)."""
    root = Path(directory)
    if not root.is_dir():
        raise CkptDoctorError(f"--from-checkpoint {directory}: no such directory")
    if (root / METADATA).is_file():
        return [(root.name or str(root), root)]
    found = [(sub.name, sub) for sub in sorted(root.iterdir()) if (sub / METADATA).is_file()]
    if not found:
        raise CkptDoctorError(f"--from-checkpoint {directory}: no DCP checkpoint there (no {METADATA} in it or "
                              f"in its subdirectories)")
    return found

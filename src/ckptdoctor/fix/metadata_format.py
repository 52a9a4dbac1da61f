"""Which torch can read a DCP `.metadata` (and ckptdoctor's index, which pickles the same classes).

torch 2.15 added `TensorProperties.strides`: it pickles six fields where torch 2.8 to 2.14 pickle
five. Old checkpoints still load on 2.15; a checkpoint written on 2.15, by stock DCP or by the fix,
does not load before 2.15 (stock: `ValueError: too many values to unpack (expected 5)` from deep
inside pickle). Nothing else in the file names the torch that wrote it (`Metadata.version` is DCP's
"1.0.0" in 2.14 and 2.15 alike), so the pickled TensorProperties states are the evidence.

Who calls it: whoever unpickles a `.metadata` or an index and fails (`index.read_metadata_file`,
`index._read_bound_index`) asks `newer_format_problem` whether that is the reason, and then says
so in one line naming both versions instead of calling the file corrupt. `describe_format` says,
for a checkpoint that did load, which torch can read it (`check --from-checkpoint`).
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path

from .compat import installed_versions

STRIDES_FROM = (2, 15)  # the first torch whose TensorProperties carry strides
PROPERTIES = ("torch.distributed.checkpoint.metadata", "TensorProperties")


def _release(version: str) -> tuple[int, int]:
    parts = version.split("+")[0].split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return (0, 0)


def field_counts(data: bytes) -> set[int]:
    """How many fields the pickled TensorProperties states in `data` hold (5 before torch 2.15,
    6 from 2.15); empty when the pickle names none or cannot be walked."""
    counts: set[int] = set()

    class Recorder:
        def __setstate__(self, state):
            counts.add(len(state))

    class Probe(pickle.Unpickler):
        def find_class(self, module, name):
            return Recorder if (module, name) == PROPERTIES else super().find_class(module, name)

    try:
        Probe(io.BytesIO(data)).load()
    except Exception:  # noqa: BLE001 - a damaged pickle: whatever was seen before the damage counts
        pass
    return counts


def newer_format_problem(path: Path, data: bytes) -> str | None:
    """One line when `path` (its bytes `data`) was written by a torch whose format the torch
    installed here cannot read; None when that is not why it failed."""
    here = installed_versions()[0]
    if _release(here) >= STRIDES_FROM or max(field_counts(data), default=0) <= 5:
        return None
    first = ".".join(map(str, STRIDES_FROM))
    return (f"{path} was written by torch {first} or newer (its tensor properties carry strides) and torch {here} "
            f"cannot read it: resume with torch {first} or newer, or save it again from there with torch 2.14 or older")


def describe_format(metadata) -> str:
    """Which torch wrote a `.metadata` that loaded here, and which can read it (from the loaded
    object: torch 2.15+ fills `strides`, older formats load with none)."""
    first = ".".join(map(str, STRIDES_FROM))
    properties = [md.properties for md in metadata.state_dict_metadata.values() if hasattr(md, "properties")]
    if not properties:
        return "no tensor recorded: any torch reads it"
    if any(getattr(p, "strides", None) is not None for p in properties):
        return f"written by torch {first} or newer (tensor strides recorded): only torch {first} or newer reads it"
    return "written by torch 2.14 or older (no tensor strides): torch 2.8 and newer read it"

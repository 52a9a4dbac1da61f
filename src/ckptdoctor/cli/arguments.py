"""What every subcommand's flags share: reading a default from an options class, the
argument types, and the JSON report beside the printed one."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from pathlib import Path

from ..errors import CkptDoctorError


def default(options_class, name: str):
    """The default of field `name` of the dataclass `options_class`: the one place it is written."""
    field = {f.name: f for f in dataclasses.fields(options_class)}[name]
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    raise KeyError(f"{options_class.__name__}.{name} has no default")


def int_list(text: str) -> list[int]:
    """An argparse type: comma-separated integers."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError("expected at least one number")
    return values


def writable_dir(path: str) -> Path:
    """Create `path` if needed; a clear error when it cannot be written."""
    target = Path(path)
    try:
        target.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise CkptDoctorError(f"cannot create output directory {target}: {error.strerror}") from None
    if not os.access(target, os.W_OK):
        raise CkptDoctorError(f"output directory {target} is not writable")
    return target.absolute()


def write_json(path: str | None, data) -> None:
    """The machine-readable report, when a path was given."""
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(data, indent=1, default=str))

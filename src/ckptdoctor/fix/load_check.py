"""Before a load: every DCP checkpoint has its index and every data file its chunks need.

Rank 0 does this once, so that a missing or truncated file is one clear error before any rank
reads, and a stock checkpoint gets its index (one unpickle of `.metadata` here instead of one on
every rank).
"""

from __future__ import annotations

import logging
from pathlib import Path

from .accelerate_layout import is_dcp_name
from .agreement import OK
from .index import (INDEX_NAME, METADATA_NAME, CorruptCheckpoint, NotIndexable, data_file_extents, read_index,
                    read_metadata_file, write_index)

log = logging.getLogger(__name__)


def prepare_for_load(state_dir: Path) -> str:
    """Rank 0, before a load: every DCP checkpoint in `state_dir` has its index (made now, once,
    for a checkpoint stock DCP wrote) and every data file its chunks need, whole. Returns OK or
    the first problem, naming the file."""
    try:
        checkpoints = dcp_checkpoints(Path(state_dir))
        for directory in checkpoints:
            for name, extent in data_file_extents(_indexed(directory)).items():
                file = directory / name
                if not file.is_file():
                    return f"{file} is missing"
                if file.stat().st_size < extent:
                    return f"{file} is truncated: {file.stat().st_size} bytes, its chunks reach {extent}"
    except CorruptCheckpoint as problem:
        return str(problem)
    return OK


def dcp_checkpoints(root: Path, depth: int = 2) -> list[Path]:
    """The DCP checkpoint directories in `root` (an Accelerate state directory, or the step
    directory holding one): those with a `.metadata` or an index, or named as Accelerate names
    its model and optimizer checkpoints."""
    found = []
    for entry in sorted(root.iterdir()):
        if not entry.is_dir():
            continue
        if (entry / METADATA_NAME).exists() or (entry / INDEX_NAME).exists() or \
                is_dcp_name(entry.name):
            found.append(entry)
        elif depth > 1:
            found += dcp_checkpoints(entry, depth - 1)
    return found


def _indexed(directory: Path):
    """The checkpoint's storage index: from its index file, made now if it has none (a stock
    checkpoint: one unpickle of .metadata here instead of one on every rank), or, where no index
    can be written, the unpickled .metadata's own."""
    metadata = read_index(directory)
    if metadata is not None:
        return metadata.storage_data
    stock = read_metadata_file(directory)
    try:
        write_index(directory, stock)
    except (OSError, NotIndexable) as reason:  # read-only, or chunks the index has no column for
        log.info("ckptdoctor: %s stays without an index (%s): every rank reads its .metadata", directory, reason)
        return stock.storage_data
    return read_index(directory).storage_data

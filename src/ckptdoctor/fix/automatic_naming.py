"""Accelerate's automatic checkpoint naming and `total_limit`, with the fix's publication.

With `ProjectConfiguration(automatic_checkpoint_naming=True)`, Accelerate's `save_state()` ignores
any directory it is given and writes `<project_dir>/checkpoints/checkpoint_<i>` (i is
`save_iteration`, counted up after each save); it refuses a name that exists. With
`total_limit=K` it first deletes the oldest folders there so that K are left counting the new
one: a save that then fails leaves K-1. `load_state()` without a directory loads the folder with
the highest number, whether its save finished or not.

The fix keeps the names, the counter and the refusal, and changes the order
(`ScalableCheckpointing.save_state` / `load_state`, every rank):

1. rank 0 names the checkpoint (`next_directory`) and every rank receives the name;
2. the save runs with Accelerate's naming switched off for that call (`explicit_directory`:
   otherwise Accelerate would replace the staging directory with its own name), and the
   checkpoint is published atomically (publish.py);
3. only then rank 0 removes the oldest *complete* checkpoints beyond K (`remove_beyond_limit`),
   so at least min(K, saves so far) complete checkpoints exist at every moment; what failed
   saves left is removed by the next successful commit, as for any save.

`load_state()` without a directory loads the newest complete checkpoint there
(`ScalableCheckpointing.latest`), never a half-written one.
"""

from __future__ import annotations

import contextlib
import logging
import re
import shutil
from pathlib import Path

from ..errors import CkptDoctorError
from .publish import complete_steps

log = logging.getLogger(__name__)
NAME = re.compile(r"checkpoint_(\d+)")


def enabled(accelerator) -> bool:
    """Whether Accelerate names this Accelerator's checkpoints (an object that only looks like
    one, without a project configuration, does not)."""
    config = getattr(accelerator, "project_configuration", None)
    return bool(getattr(config, "automatic_checkpoint_naming", False))


def checkpoints_dir(accelerator) -> Path:
    return Path(accelerator.project_dir) / "checkpoints"


def next_directory(accelerator) -> Path:
    """Rank 0: the directory of the next save, refused as stock refuses it when it exists."""
    target = checkpoints_dir(accelerator) / f"checkpoint_{accelerator.save_iteration}"
    if target.exists():
        raise CkptDoctorError(f"checkpoint directory {target} ({accelerator.save_iteration}) already exists; set "
                              f"accelerator.project_configuration.iteration to the iteration to start with; "
                              f"nothing was saved")
    return target


@contextlib.contextmanager
def explicit_directory(accelerator):
    """For one call: Accelerate's save_state writes into the directory it is given."""
    config = accelerator.project_configuration
    previous, config.automatic_checkpoint_naming = config.automatic_checkpoint_naming, False
    try:
        yield
    finally:
        config.automatic_checkpoint_naming = previous


def remove_beyond_limit(root: Path, limit: int) -> list[Path]:
    """Rank 0, after a commit: remove the oldest complete `checkpoint_<i>` beyond the newest
    `limit`. Returns what it removed."""
    steps = [path for path in complete_steps(root) if NAME.fullmatch(path.name)]
    removed = steps[limit:]
    for path in removed:
        shutil.rmtree(path)
        log.info("ckptdoctor: removed %s (total_limit=%d; the newest %d complete checkpoints are kept)",
                 path, limit, limit)
    return removed

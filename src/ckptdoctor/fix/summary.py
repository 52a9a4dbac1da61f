"""One INFO line per save and load, on rank 0: what was published or read, time per phase, bytes.

    ckptdoctor: saved <root>/ckpt/step-1/accelerator in 0.1 s (save_state 0.1 s), 2 DCP checkpoint(s), 10.7 KB

(a 4-rank job of tests/fix/test_checkpointing.py; phases under 0.05 s are left out)

The lines go to the "ckptdoctor" logger. A trainer that never configured logging (MOVA prints)
would show nothing below WARNING, so when no handler would take the records, one stderr handler
is attached to that logger; a trainer's own logging configuration is left alone.
CKPTDOCTOR_LOG_LEVEL (settings.py) turns it up (DEBUG) or down (WARNING).
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import time

LOGGER = "ckptdoctor"


@dataclasses.dataclass
class OperationRecord:
    """The phases of one save or load as this rank saw them, and what rank 0's writer wrote."""

    started: float = dataclasses.field(default_factory=time.monotonic)
    phases: dict[str, float] = dataclasses.field(default_factory=dict)
    bytes_written: int = 0
    checkpoints: int = 0
    stalled: float | None = None  # async saves: how long the training thread waited (background.py)
    host_copy: int = 0            # async saves: bytes of this rank's host copy
    ended: float | None = None    # when the save was published (time.monotonic())

    def add(self, phase: str, seconds: float) -> None:
        self.phases[phase] = self.phases.get(phase, 0.0) + seconds

    def line(self, verb: str, path) -> str:
        total = time.monotonic() - self.started
        phases = ", ".join(f"{name} {seconds:.1f} s" for name, seconds in self.phases.items() if seconds >= 0.05)
        written = f", {self.checkpoints} DCP checkpoint(s), {_size(self.bytes_written)}" if self.checkpoints else ""
        waited = "" if self.stalled is None else \
            f"; in the background: training waited {self.stalled:.1f} s, host copy {_size(self.host_copy)} on rank 0"
        return f"ckptdoctor: {verb} {path} in {total:.1f} s ({phases or 'no phase over 0.05 s'}){written}{waited}"


def _size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n} B"


def make_visible() -> None:
    """Attach a stderr handler at INFO to the "ckptdoctor" logger when no handler would show
    its records (no handler on it or above it); otherwise leave logging as the trainer set it."""
    logger = logging.getLogger(LOGGER)
    if logger.hasHandlers():
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger.addHandler(handler)
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)

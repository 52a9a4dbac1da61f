"""Explaining failed checkpoints: from logs (``logs``, read by ``scan``, judged in ``verdict``)
and from frames (``callpath``). Pure analysis: no torch import. (Per-rank DCP event timelines
are the lab's: repro/timeline.py.)"""

from .logs import diagnose, format_report

__all__ = ["diagnose", "format_report"]

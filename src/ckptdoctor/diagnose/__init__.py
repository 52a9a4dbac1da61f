"""Explaining failed checkpoints: from logs (``logs``), from frames (``callpath``), and from
per-rank DCP events (``timeline``). Pure analysis: no torch import."""

from .logs import diagnose, format_report

__all__ = ["diagnose", "format_report"]

"""ckptdoctor: reproduce, explain and fix distributed-checkpoint hangs in FSDP2 + Accelerate.

The package's concerns, one sub-package each:

* ``ckptdoctor.fix``: what a training job imports (planner, storage writer, checkpointing,
  save watchdog). Needs torch (and Accelerate for ``ScalableCheckpointing``), nothing else.
* ``ckptdoctor.diagnose``: reading logs of failed saves and loads (no torch needed).
* ``ckptdoctor.check`` and ``ckptdoctor.selftest``: what a user runs before and on the cluster
  (a prediction of rank 0's planning at N ranks; a save and load under the job's launcher).
* ``ckptdoctor.repro`` and ``ckptdoctor.simulate``: the lab, which reproduces the hang with
  real processes and simulates rank 0's work at thousands of ranks.

This module exports the trainer-facing names and imports none of the lab. They load on
first use, so that ``import ckptdoctor`` (and the CLI's log diagnosis) costs no torch import.
"""

__version__ = "0.2.0"
__all__ = ["install", "ScalableSavePlanner", "ScalableFileSystemWriter", "ScalableCheckpointing", "CheckpointAborted",
           "SaveWatchdog"]
_HOMES = {"install": "install", "ScalableSavePlanner": "planner", "ScalableFileSystemWriter": "storage",
          "ScalableCheckpointing": "checkpointing", "CheckpointAborted": "agreement", "SaveWatchdog": "watchdog"}


def __getattr__(name):
    if name in _HOMES:
        import importlib

        return getattr(importlib.import_module(f".fix.{_HOMES[name]}", __name__), name)
    raise AttributeError(f"module 'ckptdoctor' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + __all__)

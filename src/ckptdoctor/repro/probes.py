"""Observe a running save without changing it: DCP's logger events and timed collectives.

Three probes, all read-only:

* torch wraps the steps of `dcp.save` in `_dcp_method_logger`, which logs start/end events
  with nanosecond timestamps to its DCP logger at DEBUG level; a logging handler there sees
  every step of the real save.
* how long a rank waited inside the plan exchange is not logged anywhere, so the object
  collectives DCP calls through the `torch.distributed` namespace (`dist.gather_object`,
  `dist.scatter_object_list`, ...) and `dist.barrier` are wrapped with a timer, and so are
  the gloo operations those object collectives call as module globals of
  `distributed_c10d` (`broadcast`, `scatter`, `gather`, `all_gather`): each of those is
  one wait with its own gloo deadline, which is what the reproduction must measure (an
  object collective also pickles and unpickles, which is work, not waiting).
* with `time_collectives`, `DefaultSavePlanner.create_local_plan` (the planner Accelerate
  passes to `dist_cp.save`) is wrapped too, to keep each rank's local plan: the simulator
  is tested against these real plans item by item.
  These are the lab's monkeypatches (the product's are `selftest/accelerate_cpu.py`'s, for
  CPU-only hosts, and `fix/auto.py`'s, opt-in): pass-through wrappers, checked against the torch
  versions we pin (tests assert the calls are seen), undone by `uninstall()`. Where
  torch_npu is installed it is imported first: it replaces `gather_object` on import, and the
  wrapper must time the function the save will call.
"""

from __future__ import annotations

import functools
import logging
import os
import time

from ..errors import UnsupportedVersion
from .timeline import CollectiveCall, StepEvent
from ..fix.watchdog import dcp_logger

# "broadcast" here is torch.distributed.broadcast as callers outside DCP reach it (Accelerate's
# data loader synchronises RNG states with it on the default group); DCP's own reach c10d's.
TIMED_COLLECTIVES = ("gather_object", "scatter_object_list", "broadcast_object_list", "all_gather_object", "barrier",
                     "broadcast")
TIMED_GLOO_OPS = ("broadcast", "scatter", "gather", "all_gather")  # recorded as "c10d.<name>"
LOGGED_FUNCTIONS = ("save", "_save_state_dict", "local_step", "global_step", "write_data", "finish_checkpoint")
CHECKED_TORCH = ("2.8.0", "2.14.1", "2.15.0")


def save_key(name: str, round_: int) -> str:
    """A save's key in the events: its directory name, "@<round>" from the second save of that
    name on (a job that saves step-1 and then final saves optimizer_0 twice)."""
    return name if round_ == 0 else f"{name}@{round_}"


def import_torch_npu_first() -> None:
    """torch_npu replaces `torch.distributed.gather_object` when it is imported (on an HCCL-only
    group: a broadcast plus an all-gather). A wrapper installed before that import would time the
    function it replaces, and the save would never call it: where torch_npu is installed, import
    it before wrapping."""
    import importlib.util

    if importlib.util.find_spec("torch_npu") is not None:
        import torch_npu  # noqa: F401


class SaveProbe(logging.Handler):
    """Records this rank's DCP step events and object-collective calls."""

    def __init__(self, rank: int):
        super().__init__(level=logging.DEBUG)
        self.rank = rank
        self.events: list[StepEvent] = []
        self.calls: list[CollectiveCall] = []
        self.plans: list[dict] = []  # {"save"|"load": dir name, "items": signature} per save plan / read plan
        self._originals: dict[tuple[object, str], object] = {}
        self._rounds: dict[str, int] = {}  # how many saves of each checkpoint name this rank began

    # -- DCP logger events --------------------------------------------------------------
    def emit(self, record: logging.LogRecord) -> None:
        msg = record.msg
        if not isinstance(msg, dict) or msg.get("func_name") not in LOGGED_FUNCTIONS:
            return
        name = os.path.basename(os.path.normpath(msg.get("checkpoint_id") or ""))
        event = msg.get("event", "?")
        if msg["func_name"] == "save" and event == "start":
            self._rounds[name] = self._rounds.get(name, -1) + 1
        self.events.append(StepEvent(
            rank=self.rank, save=save_key(name, self._rounds.get(name, 0)),
            step=msg["func_name"], event=event,
            time_s=msg.get("time", time.time_ns()) / 1e9, error=msg.get("error")))

    # -- timed collectives --------------------------------------------------------------
    def _timed(self, name: str, func):
        import torch.distributed as dist

        @functools.wraps(func)
        def wrapper(*args, **kwargs):
            group = kwargs.get("group")
            start, ok = time.time(), False
            try:
                result = func(*args, **kwargs)
                ok = True
                return result
            finally:
                self.calls.append(CollectiveCall(self.rank, name, start, time.time(), ok,
                                                 default_group=group is None or group is dist.group.WORLD))
        return wrapper

    def install(self, time_collectives: bool = True) -> "SaveProbe":
        from ..fix.compat import installed_versions

        if time_collectives and installed_versions()[0] not in CHECKED_TORCH:
            raise UnsupportedVersion(f"collective timing is checked on torch {', '.join(CHECKED_TORCH)} only")
        dcp_logger().addHandler(self)
        if time_collectives:
            import_torch_npu_first()
            import torch.distributed as dist
            from torch.distributed import distributed_c10d as c10d

            for module, names, prefix in ((dist, TIMED_COLLECTIVES, ""), (c10d, TIMED_GLOO_OPS, "c10d.")):
                for name in names:
                    original = self._originals[(module, name)] = getattr(module, name)
                    setattr(module, name, self._timed(prefix + name, original))
            self._record_local_plans()
        return self

    def _record_local_plans(self) -> None:
        from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

        from ..check.save_phases import plan_signature

        original = self._originals[(DefaultSavePlanner, "create_local_plan")] = DefaultSavePlanner.create_local_plan
        probe = self

        @functools.wraps(original)
        def create_local_plan(planner):
            plan = original(planner)
            save = next((e.save for e in reversed(probe.events) if e.step == "local_step"), "?")
            probe.plans.append({"save": save, "items": plan_signature(plan)})
            return plan

        DefaultSavePlanner.create_local_plan = create_local_plan
        self._record_read_plans()

    def _record_read_plans(self) -> None:
        """The read plan every rank executes, at FileSystemReader.read_data (stock's reader and ours)."""
        from torch.distributed.checkpoint import FileSystemReader

        from ..check.load_phases import read_plan_signature

        original = self._originals[(FileSystemReader, "read_data")] = FileSystemReader.read_data
        probe = self

        @functools.wraps(original)
        def read_data(reader, plan, planner):
            probe.plans.append({"load": os.path.basename(os.path.normpath(str(reader.path))),
                                "items": read_plan_signature(plan)})
            return original(reader, plan, planner)

        FileSystemReader.read_data = read_data

    def uninstall(self) -> None:
        dcp_logger().removeHandler(self)
        for (module, name), original in self._originals.items():
            setattr(module, name, original)
        self._originals.clear()

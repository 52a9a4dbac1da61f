"""Host memory for an async save's staging copy: what the state needs, what the node has free.

An async save copies every rank's state into host memory before `save_state` returns
(background.py). Eight ranks share a node's memory, so a node without room for eight copies
would be settled by the OOM killer in the middle of training. Before the first async save every
rank compares

    need = this rank's state bytes (its parameters, buffers and optimizer state, the local
           shards under FSDP) x the ranks on its node (LOCAL_WORLD_SIZE, as torchrun and
           `accelerate launch` set it; 1 without it)
    free = MemAvailable (/proc/meminfo), or less where the process's memory cgroup (v1 or v2:
           a container's or a job scheduler's limit) leaves less below its limit

and refuses, with one line naming both, when need > free (checkpointing.py makes the refusal
the same on every rank before anything is written). The figures are estimates made on each
rank for its own node: ranks of one node read the same free memory at about the same time.
"""

from __future__ import annotations

import os
from pathlib import Path

GIB = 1024 ** 3
CGROUP_ROOT = Path("/sys/fs/cgroup")
UNLIMITED = 1 << 60  # cgroup v1 writes a huge number for "no limit"


def state_bytes(accelerator) -> int:
    """This rank's bytes of what save_state stages: every prepared model's parameters and
    buffers and every prepared optimizer's tensor state (local shards of DTensors)."""
    total = 0
    for model in getattr(accelerator, "_models", []):
        total += sum(_local_bytes(t) for t in (*model.parameters(), *model.buffers()))
    for optimizer in getattr(accelerator, "_optimizers", []):
        inner = getattr(optimizer, "optimizer", optimizer)
        for state in inner.state.values():
            total += sum(_local_bytes(v) for v in state.values() if hasattr(v, "nbytes") or hasattr(v, "to_local"))
    return total


def _local_bytes(tensor) -> int:
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.numel() * local.element_size()


def ranks_on_node() -> int:
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


def free_bytes() -> tuple[int, str]:
    """(bytes this process's node can still give it, where that figure comes from)."""
    free, source = _meminfo_available(), "MemAvailable"
    room = _cgroup_room()
    if room is not None and room[0] < free:
        free, source = room
    return free, source


def shortfall(need_per_rank: int, ranks: int, free: int, source: str) -> str | None:
    """One line saying why the node cannot stage, or None when it can."""
    need = need_per_rank * ranks
    if need <= free:
        return None
    return (f"an async save stages a host copy of the state: this node needs {need / GIB:.2f} GiB "
            f"({need_per_rank / GIB:.2f} GiB per rank x {ranks} rank(s)) and has {free / GIB:.2f} GiB free "
            f"({source}); nothing was saved: free host memory or save synchronously (async_save=False, "
            f"CKPTDOCTOR_ASYNC=0)")


def _meminfo_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return UNLIMITED


def _cgroup_room() -> tuple[int, str] | None:
    """Limit minus usage (less reclaimable page cache) of this process's memory cgroup."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        number, controllers, path = line.split(":", 2)
        if number == "0" and controllers == "":
            room = _room(CGROUP_ROOT / path.lstrip("/"), "memory.max", "memory.current", "inactive_file")
            room = room or _room(CGROUP_ROOT / "unified" / path.lstrip("/"), "memory.max", "memory.current",
                                 "inactive_file")
        elif "memory" in controllers.split(","):
            room = _room(CGROUP_ROOT / "memory" / path.lstrip("/"), "memory.limit_in_bytes",
                         "memory.usage_in_bytes", "total_inactive_file")
        else:
            continue
        if room is not None:
            return room
    return None


def _room(directory: Path, limit_file: str, usage_file: str, inactive_key: str) -> tuple[int, str] | None:
    try:
        limit_text = (directory / limit_file).read_text().strip()
        if limit_text == "max" or int(limit_text) >= UNLIMITED:
            return None
        usage = int((directory / usage_file).read_text())
        inactive = 0
        for line in (directory / "memory.stat").read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == inactive_key:
                inactive = int(value)
    except (OSError, ValueError):
        return None
    return max(0, int(limit_text) - usage + inactive), f"memory cgroup {directory}"

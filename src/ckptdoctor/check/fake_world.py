"""Torch's fake process group: one process plays rank r of N, and what it costs in memory.

Every measurement of `check` runs in a process of its own (jobs.py) as one rank of a world that
exists only in name: torch's "fake" backend answers every collective without communicating, so a
DTensor of a mesh of N ranks can be built (on meta tensors) and planned by torch's own code.
"""

from __future__ import annotations

import resource

from .layout import Layout


def init_fake_world(rank: int, ranks: int, layout: Layout):
    """A fake process group (no communication) in which this process is `rank` of `ranks`,
    and the device mesh `layout` gives it."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", rank=rank, world_size=ranks, store=FakeStore())
    return init_device_mesh("cpu", layout.mesh_shape(ranks))


def rss_bytes() -> int:
    """This process's resident memory now."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def peak_from_here() -> int:
    """This process's resident memory now, from which `peak_rss_bytes` counts: the kernel's
    high-water mark is reset to it (Linux: "5" to /proc/self/clear_refs), so that a peak is the
    measured phase's, not the job's setup's. Where it cannot be reset, the peak is the process's."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    return rss_bytes()


def peak_rss_bytes() -> int:
    """The most resident memory this process has held (since `peak_from_here`), read from its own
    memory map's high-water mark (VmHWM). Not `getrusage`'s ru_maxrss: across exec, Linux keeps the
    larger of the new image's peak and the parent's at the fork, so a job started by a large
    process (pytest, a trainer) reported the parent's peak as its own."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

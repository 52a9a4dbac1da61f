"""What the cluster decides, checked where the job runs: one `Check` per question.

Each function runs on the ranks the docstring names and returns this rank's `Check`; `merge`
turns every rank's into one verdict (failed if any rank failed, the slowest rank's time)."""

from __future__ import annotations

import dataclasses
import os
import resource
import time
from pathlib import Path

from ..fix.heartbeat import HEARTBEAT_S


@dataclasses.dataclass
class Check:
    name: str
    ok: bool | None          # None: skipped (the detail says why)
    seconds: float = 0.0
    detail: str = ""
    values: dict = dataclasses.field(default_factory=dict)

    @property
    def verdict(self) -> str:
        return {True: "PASS", False: "FAIL", None: "SKIP"}[self.ok]


def timed(name: str, work) -> Check:
    """Run `work() -> (ok, detail, values)`; an exception is a failed check naming it."""
    started = time.monotonic()
    try:
        ok, detail, values = work()
    except Exception as error:  # noqa: BLE001 - a check reports what went wrong, it does not stop the others
        ok, detail, values = False, f"{type(error).__name__}: {error}", {}
    return Check(name, ok, time.monotonic() - started, detail, values)


def merge(per_rank: list[Check]) -> Check:
    """One verdict from every rank's: failed if any failed (naming the first such rank), else
    the slowest rank's detail and values (the longest wait, the lowest capacity seen)."""
    failed = [(rank, c) for rank, c in enumerate(per_rank) if c.ok is False]
    slowest = max(range(len(per_rank)), key=lambda r: per_rank[r].seconds)
    worst = per_rank[slowest]
    if failed:
        rank, check = failed[0]
        others = f" (and {len(failed) - 1} more rank(s))" if len(failed) > 1 else ""
        detail, ok, values = f"rank {rank}: {check.detail}{others}", False, check.values
    else:
        detail, ok, values = worst.detail, None if all(c.ok is None for c in per_rank) else True, worst.values
    values = {**values, "slowest_rank": slowest, "failed_ranks": [r for r, _ in failed]}
    return Check(worst.name, ok, worst.seconds, detail, values)


# -- every rank ----------------------------------------------------------------------------

def directory(root: Path, rank: int) -> Check:
    """Every rank: create the test directory, write, read back and remove a file in it."""
    def work():
        root.mkdir(parents=True, exist_ok=True)
        probe = root / f".probe-{rank}"
        probe.write_bytes(b"ckptdoctor")
        if probe.read_bytes() != b"ckptdoctor":
            return False, f"{probe} read back different bytes", {}
        probe.unlink()
        return True, f"every rank wrote, read and removed a file in {root}", {}
    return timed("directory", work)


def directory_fsync(root: Path) -> Check:
    """Every rank: fsync a directory (the publish protocol fsyncs the step and its parent)."""
    from ..fix.publish import fsync_directory

    def work():
        fsync_directory(root)
        return True, "fsync of a directory works", {}
    return timed("directory fsync", work)


def open_files(job_ranks: int) -> Check:
    """Every rank: the soft open-file limit against what two full-mesh gloo groups of
    `job_ranks` need (the job's and the checkpoint group: a socket per peer each) plus room."""
    def work():
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        need = 2 * (job_ranks - 1) + 1024
        values = {"soft_limit": soft, "hard_limit": hard, "needed": need, "job_ranks": job_ranks}
        if soft != resource.RLIM_INFINITY and soft < need:
            return False, (f"ulimit -n is {soft}; {job_ranks} ranks need about {need} (2 gloo groups x "
                           f"{job_ranks - 1} peers + 1024); raise it to at least {need} (hard limit {hard})"), values
        return True, f"ulimit -n {soft} >= {need} needed at {job_ranks} ranks", values
    return timed("open files", work)


# -- rank 0 --------------------------------------------------------------------------------

def free_space(root: Path, need_bytes: int) -> Check:
    """Rank 0: free space on the checkpoint file system against `need_bytes`."""
    def work():
        stat = os.statvfs(root)
        free = stat.f_bavail * stat.f_frsize
        values = {"free_bytes": free, "needed_bytes": need_bytes}
        if free < need_bytes:
            return False, f"{_gb(free)} free in {root}, {_gb(need_bytes)} needed", values
        return True, f"{_gb(free)} free, {_gb(need_bytes)} needed", values
    return timed("free space", work)


def mtime_granularity(root: Path) -> Check:
    """Rank 0: the file system's mtime resolution. Informational: the fix binds its index to
    `.metadata` by size, mtime, inode and sha256, so a coarse clock costs a hash, not safety."""
    def work():
        probe = root / ".mtime-probe"
        stamps = []
        for i in range(12):
            probe.write_bytes(bytes([i]))
            stamps.append(probe.stat().st_mtime_ns)
            time.sleep(0.003)
        probe.unlink()
        granularity = max(g for g in (1, 1_000, 1_000_000, 1_000_000_000) if all(s % g == 0 for s in stamps))
        steps = sorted({b - a for a, b in zip(stamps, stamps[1:]) if b > a})
        label = {1: "ns", 1_000: "us", 1_000_000: "ms", 1_000_000_000: "s"}[granularity]
        seen = f", smallest step seen {steps[0] / 1e6:.3f} ms" if steps else ", no change seen in 36 ms"
        return True, f"mtimes in whole {label}{seen}", {"granularity_ns": granularity,
                                                        "smallest_step_ns": steps[0] if steps else None}
    return timed("mtime granularity", work)


# -- collective ----------------------------------------------------------------------------

def store_capacity(store, rank: int, world_size: int, job_ranks: int, requests: int = 200) -> Check:
    """Every rank at once: `requests` set+get pairs on the job's store. Capacity (requests/s,
    all ranks together) against the heartbeats' load at `job_ranks`: each rank posts once per
    interval and reads one multi-get, rank 0 reads every key once (about 2 N requests/s)."""
    def work():
        key = f"ckptdoctor/selftest/store/{rank}"
        started = time.monotonic()
        for i in range(requests):
            store.set(key, str(i))
            store.get(key)
        elapsed = time.monotonic() - started
        capacity = 2 * requests * world_size / elapsed if elapsed > 0 else float("inf")
        load = 2 * job_ranks / HEARTBEAT_S
        values = {"capacity_per_s_lower_bound": round(capacity), "heartbeat_load_per_s": round(load),
                  "requests_per_rank": 2 * requests}
        if load > 0.5 * capacity:
            return False, (f"the store served about {capacity:.0f} requests/s here; heartbeats at {job_ranks} ranks "
                           f"need {load:.0f}/s (more than half)"), values
        return True, f"about {capacity:.0f} requests/s served; heartbeats at {job_ranks} ranks need {load:.0f}/s", values
    return timed("store load", work)


def _gb(n: int) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"

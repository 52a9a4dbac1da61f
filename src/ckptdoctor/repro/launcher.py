"""Start N ranks as real processes on this machine, the way torchrun does.

Each rank gets the torchrun environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT).
With `agent_store`, the launcher hosts the job's TCP store itself, as torchrun's agent does
(TORCHELASTIC_USE_AGENT_STORE): every rank is a client, and the store outlives rank 0.
Output goes to one combined log with a `[rankN]:` prefix on every line. When a rank fails,
the others get `grace_s` to fail on their own, then are torn down (SIGTERM, then SIGKILL),
as torchrun's agent tears a job down. Once some rank has ended and every rank left is stopped
(SIGSTOP, a fault the tests inject), those are torn down at once: none of them can act again.
The test suite forks its ranks from a zygote that has imported torch once (zygote.py says
what that changes). Under torchrun (MOVA's harness: `accelerate launch`), `wait_for_torchrun` does the same for a
rank a fault froze: SIGKILL as soon as torchrun's SIGTERM waits for it, where torchrun itself
would wait 30 s first.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from ..ports import free_port
from .zygote import Zygote

# Fresh interpreters, as torchrun starts them; the test suite forks its ranks from a zygote
# instead (tests/conftest.py; CKPTDOCTOR_FRESH_RANKS=1 turns that off).
PRELOADED_BY_DEFAULT = False


@dataclasses.dataclass
class JobResult:
    returncodes: list[int]
    log_path: Path
    wall_s: float
    torn_down: list[int]  # ranks the launcher had to terminate


def _pump(stream, rank: int, log, lock: threading.Lock, echo) -> None:
    prefix = f"[rank{rank}]:"
    for raw in iter(stream.readline, b""):
        line = raw.decode(errors="replace").rstrip("\n")
        if not line.startswith(prefix):
            line = f"{prefix} {line}"
        with lock:
            log.write(line + "\n")
            log.flush()
        if echo:
            echo(line)


def launch(args: list[str], world_size: int, log_path: Path, *, grace_s: float = 5.0,
           timeout_s: float = 1800.0, env: dict | None = None, echo=None, python: str | None = None,
           agent_store: bool = False, preloaded: bool | None = None) -> JobResult:
    """Run `python <args>` as `world_size` ranks (this interpreter unless `python` names
    another); returns when all have exited. `preloaded`: fork the ranks from a zygote that has
    imported torch (zygote.py; default PRELOADED_BY_DEFAULT), where this interpreter runs them."""
    port = free_port()
    store = _agent_store(port, world_size, timeout_s) if agent_store else None
    if store is not None:
        env = {**(env or {}), "TORCHELASTIC_USE_AGENT_STORE": "True"}
    base_env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                "WORLD_SIZE": str(world_size), "LOCAL_WORLD_SIZE": str(world_size),
                "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    log_path.parent.mkdir(parents=True, exist_ok=True)
    preloaded = PRELOADED_BY_DEFAULT if preloaded is None else preloaded
    zygote = Zygote.get(sys.executable, base_env) if preloaded and python in (None, sys.executable) else None
    lock, threads, procs = threading.Lock(), [], []
    start = time.time()
    with open(log_path, "w") as log:
        for rank in range(world_size):
            rank_env = {**base_env, "RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0"}
            if zygote is not None:
                proc = zygote.fork(args, rank_env)
            else:
                proc = subprocess.Popen([python or sys.executable, *args], env=rank_env, stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, start_new_session=True)
            procs.append(proc)
            thread = threading.Thread(target=_pump, args=(proc.stdout, rank, log, lock, echo), daemon=True)
            thread.start()
            threads.append(thread)
        torn_down = _supervise(procs, grace_s, timeout_s, start)
        for thread in threads:
            thread.join(timeout=10)
    del store  # the agent's store lives as long as the job
    return JobResult([p.returncode for p in procs], log_path, time.time() - start, torn_down)


def _agent_store(port: int, world_size: int, timeout_s: float):
    import datetime

    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", port, world_size, True, timeout=datetime.timedelta(seconds=timeout_s),
                         wait_for_workers=False)


def _supervise(procs: list[subprocess.Popen], grace_s: float, timeout_s: float, start: float) -> list[int]:
    first_failure = None
    while any(p.poll() is None for p in procs):
        now = time.time()
        if first_failure is None and any(p.poll() not in (None, 0) for p in procs):
            first_failure = now
        if (first_failure is not None and now - first_failure > grace_s) or now - start > timeout_s or \
                _only_stopped_ranks_left(procs):
            return _tear_down(procs)
        time.sleep(0.1)
    return []


def _only_stopped_ranks_left(procs: list[subprocess.Popen]) -> bool:
    """Some rank has ended and every rank still running is stopped (SIGSTOP): nothing can change
    any more, so waiting out the grace or the timeout would only spend the caller's time."""
    alive = [p for p in procs if p.poll() is None]
    return len(alive) < len(procs) and all(stopped(p.pid) for p in alive)


def stopped(pid: int) -> bool:
    """The process is stopped (SIGSTOP); False once it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] in "Tt"  # the state field follows the command name in parentheses


def asked_to_terminate(pid: int) -> bool:
    """A SIGTERM waits for the process (pending: a stopped process cannot take it)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    pending = 0
    for line in status.splitlines():
        if line.startswith(("SigPnd:", "ShdPnd:")):
            pending |= int(line.split()[1], 16)
    return bool(pending & (1 << (signal.SIGTERM - 1)))


def _tear_down(procs: list[subprocess.Popen]) -> list[int]:
    alive = [rank for rank, p in enumerate(procs) if p.poll() is None]
    for rank in alive:  # a stopped rank cannot act on SIGTERM: it would only wait out the 10 s
        if stopped(procs[rank].pid):
            os.killpg(procs[rank].pid, signal.SIGKILL)
        else:
            procs[rank].send_signal(signal.SIGTERM)
    deadline = time.time() + 10
    for rank in alive:
        try:
            procs[rank].wait(timeout=max(0.1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            os.killpg(procs[rank].pid, signal.SIGKILL)
            procs[rank].wait()
    return alive


def wait_for_torchrun(proc: subprocess.Popen, frozen_pid: Path, deadline: float) -> int:
    """Wait for a launch through torchrun (`accelerate launch`); its exit code, or -1 past
    `deadline` (the whole session is killed). `frozen_pid` names the file where a fault writes the
    pid of the rank it stopped.
    A rank the fault froze (SIGSTOP) cannot act on torchrun's SIGTERM: torchrun would wait 30 s
    for it, then SIGKILL it. Once that SIGTERM is pending, the SIGKILL is sent at once: a node that
    vanished ends no differently, and the 30 s would only spend the test's time."""
    while proc.poll() is None:
        if time.time() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return -1
        if frozen_pid.exists():
            pid = int(frozen_pid.read_text() or 0)
            if pid and stopped(pid) and asked_to_terminate(pid):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.2)
    return proc.returncode

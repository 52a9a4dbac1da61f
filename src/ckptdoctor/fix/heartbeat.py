"""Liveness during a checkpoint: heartbeats on the job's TCP store.

When a rank dies, the others name it; when a rank stops answering without closing its
connections (a lost node, a frozen process), rank 0 notices within `lost_after_s` and every
rank leaves with EXIT_LOST_RANK instead of waiting out the checkpoint group's timeout.

A rank that is alive but busy is not lost. Its heartbeat is posted by a Python thread, which
waits while the main thread holds the GIL (a long pickle, a long native call), and also by a
forked child process (`ProcessBeat`) that asks the kernel whether the rank's process is still
there and not stopped: either poster keeps the rank alive.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time

from .agreement import OK

log = logging.getLogger(__name__)
HEARTBEAT_S = 1.0      # during a checkpoint each rank posts a heartbeat this often
LOST_RANK_S = 300.0    # a rank silent this long (with its connections open) is taken as lost
EXIT_LOST_RANK = 75    # the exit code when a rank is lost (EX_TEMPFAIL: the launcher may restart)
STORE_LOST_GRACE_S = 10.0  # the main thread's own error about a lost store goes first


def store_host() -> str:
    """Who hosts the job's TCP store: torchrun's agent, or rank 0's process (env:// elsewhere)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return "the launcher's agent (it hosts the job's store)"
    return "rank 0 (its process hosts the job's store)"


def job_store():
    """The job's TCP store (torch keeps it privately; 2.8 and 2.14 expose it the same way).
    Under torchrun it lives in the agent, otherwise in rank 0's process."""
    import torch.distributed as dist

    return dist.distributed_c10d._get_default_store()


class Heartbeat:
    """While a checkpoint runs, a daemon thread posts this rank's heartbeat on the job's store
    (one key per rank: "alive:<n>", "aborted:<n>" or "idle:<n>"). Rank 0's thread reads every
    rank's key in one request; a rank alive but unchanged for `lost_after_s` is lost, and rank
    0 posts a verdict. Every other rank reads the verdict and rank 0's key in one request.
    So each rank makes O(1) store requests per interval, rank 0 one more."""

    def __init__(self, store, prefix: str, rank: int, world_size: int, interval_s: float = HEARTBEAT_S,
                 lost_after_s: float = LOST_RANK_S, on_lost=None, use_process: bool = True):
        self.store, self.prefix, self.rank, self.world_size = store, prefix, rank, world_size
        self.interval_s, self.lost_after_s = interval_s, lost_after_s
        self.on_lost = on_lost or log_lost
        self.seq = 0
        self.store_lost = False
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._child = ProcessBeat(store, self.key(rank), interval_s) if use_process else None
        self._post("idle")  # every key exists before any checkpoint: reading them never blocks

    def key(self, rank: int) -> str:
        return f"{self.prefix}beat/{rank}"

    def _post(self, state: str) -> None:
        self.seq += 1
        self._set(self.key(self.rank), f"{state}:{self.seq}")

    def _set(self, key: str, value: str) -> None:
        """Best effort: on the way out of a failed checkpoint the store may be gone with rank 0's
        process, and that must not replace the CheckpointAborted being raised."""
        try:
            self.store.set(key, value)
        except Exception:  # noqa: BLE001 - DistNetworkError, DistStoreError, ...
            self.store_lost = True

    def open_verdict(self, token: str) -> None:
        """Rank 0, before it tells the others `token`: the key they will read exists."""
        self.store.set(f"{self.prefix}verdict/{token}", OK)

    def start(self, token: str) -> None:
        """Every rank, after a collective every rank took part in (the token broadcast)."""
        self.stop()
        self.verdict_key = f"{self.prefix}verdict/{token}"
        self._post("alive")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ckptdoctor-heartbeat", daemon=True)
        self._thread.start()
        if self._child is not None:
            self._child.start()

    def stop(self, aborted: bool = False) -> None:
        if self._child is not None:
            self._child.stop()  # before the last post: the child must not overwrite it
        if self._thread is not None:
            self._stop.set()
            self._thread.join(timeout=5)
            self._thread = None
        self._post("aborted" if aborted else "idle")

    def mark_aborted(self) -> None:
        """This rank gives up on its own: not a rank that disappeared."""
        self._set(self.key(self.rank), f"aborted:{self.seq}")

    def _run(self) -> None:
        watch = Staleness(self.lost_after_s)
        try:
            while not self._stop.wait(self.interval_s):
                self._post("alive")
                if self.rank == 0:
                    values = self.store.multi_get([self.key(r) for r in range(self.world_size)])
                    lost = watch.update({r: v.decode() for r, v in enumerate(values)})
                    if lost:
                        self.store.set(self.verdict_key, f"rank(s) {', '.join(map(str, lost))} stopped answering "
                                                         f"for {self.lost_after_s:.0f} s")
                    verdict = self.store.get(self.verdict_key).decode()
                else:
                    verdict, beat0 = (v.decode() for v in self.store.multi_get([self.verdict_key, self.key(0)]))
                    if watch.update({0: beat0}):
                        verdict = f"rank 0 stopped answering for {self.lost_after_s:.0f} s"
                if verdict != OK:
                    self.on_lost(self.rank, verdict)
                    return
        except Exception as error:  # noqa: BLE001 - the store went away: rank 0's process or the agent
            self.store_lost = True
            if self._stop.wait(STORE_LOST_GRACE_S):
                return  # the checkpoint ended first: its own error (CheckpointAborted) says what happened
            self.on_lost(self.rank, f"the job's store is unreachable ({str(error).strip()[:120]}): {store_host()} "
                                    f"is gone")

    def gone(self, wait_s: float | None = None) -> list[int]:
        """Ranks that disappeared: alive but unchanged over `wait_s`, and not aborted on their
        own. Two requests however many ranks there are."""
        wait_s = 3 * self.interval_s if wait_s is None else wait_s
        keys = [self.key(r) for r in range(self.world_size)]
        try:
            before = [v.decode() for v in self.store.multi_get(keys)]
            time.sleep(wait_s)
            after = [v.decode() for v in self.store.multi_get(keys)]
        except Exception:  # noqa: BLE001 - the store is gone: whoever hosted it left (store_host)
            self.store_lost = True
            return []
        return [r for r in range(self.world_size) if r != self.rank and after[r] == before[r]
                and after[r].startswith("alive:")]


class NoHeartbeat:
    """One process without a process group: no peer to watch and no store to post on. Keeps
    Heartbeat's interface so that ScalableCheckpointing runs the same steps either way."""

    store_lost = False

    def open_verdict(self, token: str) -> None:
        pass

    def start(self, token: str) -> None:
        pass

    def stop(self, aborted: bool = False) -> None:
        pass

    def mark_aborted(self) -> None:
        pass

    def gone(self, wait_s: float | None = None) -> list[int]:
        return []


class ProcessBeat:
    """A forked child that posts "alive" on its parent's heartbeat key every interval while the
    parent process exists and is not stopped (SIGSTOP, a debugger), as /proc says. It needs no
    GIL of the parent's: a rank whose main thread is busy stays alive. It closes every inherited
    descriptor (a dead rank's sockets close at once, as without it), talks to the store over a
    connection of its own, and leaves when its parent is gone, stopped, or stops it.

    It runs none of the trainer's signal handlers: a fork inherits them, and a launcher that
    signals the whole process group (SIGTERM at teardown) would otherwise run the trainer's own
    SIGTERM code (a report, an emergency save) a second time, in the child, on a stale copy of the
    trainer. Those signals are blocked across the fork and the child takes their default action."""

    def __init__(self, store, key: str, interval_s: float):
        self.store, self.key, self.interval_s = store, key, interval_s
        self.pid: int | None = None

    def start(self) -> None:
        """Best effort: a rank that cannot fork (no memory, a process limit) keeps its thread's
        heartbeat and goes on; raising here, before the checkpoint's first collective, would
        leave the other ranks waiting in it."""
        self.stop()
        parent = os.getpid()
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, CHILD_DEFAULTS)
        try:
            pid = os.fork()
        except OSError as error:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
            log.warning("ckptdoctor: cannot fork the heartbeat's child (%s); the thread alone posts", error)
            return
        if pid == 0:  # the child: no logging, no threads, no return into the parent's code
            code = 0
            try:
                for signum in CHILD_DEFAULTS:
                    signal.signal(signum, signal.SIG_DFL)
                signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
                self._post_while_running(parent)
            except BaseException:  # noqa: BLE001 - the thread still posts; never raise in a fork
                code = 1
            os._exit(code)
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        self.pid = pid

    def stop(self) -> None:
        if self.pid is None:
            return
        try:
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
        self.pid = None

    def _post_while_running(self, parent: int) -> None:
        devnull = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(devnull, fd)
        os.closerange(3, _max_fd())
        store, seq = self.store.clone(), 0
        while os.getppid() == parent and process_state(parent) not in STOPPED_OR_GONE:
            seq += 1
            store.set(self.key, f"alive:p{seq}")
            time.sleep(self.interval_s)


STOPPED_OR_GONE = {"T", "t", "Z", "X", None}
CHILD_DEFAULTS = {signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2}


def process_state(pid: int) -> str | None:
    """The process's state letter from /proc (R, S, D running or waiting; T stopped; Z gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rsplit(b")", 1)[1].split()[0].decode()
    except (OSError, IndexError):
        return None


def _max_fd() -> int:
    try:
        return os.sysconf("SC_OPEN_MAX")
    except (ValueError, OSError):
        return 65536


class Staleness:
    """Per rank, how long its heartbeat value has not changed while it said "alive"."""

    def __init__(self, lost_after_s: float):
        self.lost_after_s = lost_after_s
        self.seen: dict[int, tuple[str, float]] = {}

    def update(self, values: dict[int, str]) -> list[int]:
        now, lost = time.monotonic(), []
        for rank, value in values.items():
            previous = self.seen.get(rank)
            if previous is None or previous[0] != value:
                self.seen[rank] = (value, now)
            elif value.startswith("alive:") and now - previous[1] >= self.lost_after_s:
                lost.append(rank)
        return lost


def log_lost(rank: int, verdict: str) -> None:
    log.error("ckptdoctor: rank %d: %s; the checkpoint cannot finish", rank, verdict)


def exit_lost(rank: int, verdict: str) -> None:
    """A collective waiting for a lost rank cannot be interrupted (gloo's abort does not wake
    it): leave, with a distinct exit code, so the launcher restarts the job. Nothing was
    published: the staging directory is never renamed."""
    message = f"ckptdoctor: rank {rank}: {verdict}; exiting with code {EXIT_LOST_RANK} (nothing was published)"
    log.error(message)
    print(message, file=sys.stderr, flush=True)
    os._exit(EXIT_LOST_RANK)



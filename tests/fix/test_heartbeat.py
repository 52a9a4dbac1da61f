"""Heartbeats (fix/heartbeat.py): the second poster, a forked child that keeps a busy rank alive and
leaves a frozen one; naming the ranks that left, at two store requests per survivor; staleness."""

import os
import signal
import subprocess
import sys
import time

import pytest
from torch.distributed import PrefixStore, TCPStore

from ckptdoctor.fix import heartbeat
from ckptdoctor.fix.heartbeat import Heartbeat, ProcessBeat, process_state

from support.polling import wait_for


@pytest.fixture
def store():
    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    return PrefixStore("ckptdoctor-test", server)  # as the job's store: a prefix over TCP (clone keeps both)


def seq(store, key) -> int:
    return int(store.get(key).decode().split(":p")[1])


def hold_the_gil(seconds: float) -> None:
    """Pure Python with a switch interval longer than the wait: no other thread of this
    process runs until it ends, as during a long pickle or a native call that keeps the GIL."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(seconds * 10)
    try:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            pass
    finally:
        sys.setswitchinterval(before)


def test_the_child_posts_while_the_main_thread_holds_the_gil_and_stops_when_told(store):
    beat = ProcessBeat(store, "beat/0", interval_s=0.1)
    beat.start()
    try:
        assert wait_for(lambda: store.check(["beat/0"]))  # the child connected and posted
        first = seq(store, "beat/0")
        hold_the_gil(2.0)
        during = seq(store, "beat/0") - first
    finally:
        beat.stop()
    assert during >= 1, during  # a post while this process's main thread held the GIL: not the thread's
    last = seq(store, "beat/0")
    time.sleep(0.4)
    assert seq(store, "beat/0") == last and beat.pid is None  # stopped means no more posts


def rank_process(store, tmp_path, key: str, before: str = "") -> tuple[subprocess.Popen, int]:
    """A real process standing for a rank: runs `before`, starts a ProcessBeat posting `key` on
    the test's store, and idles. Returns it and its child's pid."""
    script = tmp_path / f"rank-{key.replace('/', '-')}.py"
    script.write_text(
        "import os, signal, time\nfrom torch.distributed import PrefixStore, TCPStore\n"
        "from ckptdoctor.fix.heartbeat import ProcessBeat\n" + before +
        f"store = PrefixStore('ckptdoctor-test', TCPStore('127.0.0.1', {store.underlying_store.port}, "
        f"is_master=False))\nbeat = ProcessBeat(store, {key!r}, interval_s=0.1)\nbeat.start()\n"
        "print(beat.pid, flush=True)\ntime.sleep(60)\n")
    process = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    return process, int(process.stdout.readline())


def test_the_child_leaves_when_its_parent_is_stopped_and_when_it_is_gone(store, tmp_path):
    """The parent is a real process that starts the child, then is frozen with SIGSTOP."""
    parent, child = rank_process(store, tmp_path, "beat/1")
    try:
        assert wait_for(lambda: store.check(["beat/1"]))
        assert process_state(child) in ("S", "R") and seq(store, "beat/1") > 0
        os.kill(parent.pid, signal.SIGSTOP)
        assert wait_for(lambda: process_state(parent.pid) == "T")
        assert wait_for(lambda: process_state(child) in ("Z", None))  # it left: a frozen rank's key goes stale
        last = seq(store, "beat/1")
        time.sleep(0.4)
        assert seq(store, "beat/1") == last
    finally:
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()


def test_a_rank_that_cannot_fork_keeps_the_thread_and_goes_on(store, monkeypatch, caplog):
    def no_fork():
        raise OSError(11, "Resource temporarily unavailable")
    monkeypatch.setattr(os, "fork", no_fork)  # INJECTED: fork fails (EAGAIN), as at a process limit
    beat = ProcessBeat(store, "beat/2", interval_s=0.1)
    beat.start()
    assert beat.pid is None and "cannot fork the heartbeat's child" in caplog.text
    beat.stop()


def test_the_child_runs_none_of_the_trainers_signal_handlers(store, tmp_path):
    """A launcher's SIGTERM to the process group reaches the child too. The trainer's handler
    (here: it writes its pid to a file, as a report or an emergency save would write) must run
    in the trainer only; the child takes SIGTERM's default action and is gone."""
    ran = tmp_path / "handler-ran-in"
    trainer, child = rank_process(store, tmp_path, "beat/3", before=(
        f"signal.signal(signal.SIGTERM, lambda *a: open({str(ran)!r}, 'a').write(f'{{os.getpid()}}\\n'))\n"))
    try:
        assert wait_for(lambda: store.check(["beat/3"]))  # the child is up and posting
        os.kill(child, signal.SIGTERM)
        assert wait_for(lambda: process_state(child) in ("Z", None))
        assert not ran.exists()  # the trainer's handler did not run in the child
        os.kill(trainer.pid, signal.SIGTERM)
        assert wait_for(lambda: ran.exists() and ran.read_text() == f"{trainer.pid}\n")  # but does in the trainer
    finally:
        os.kill(trainer.pid, signal.SIGKILL)
        trainer.wait()


# -- naming the lost ranks, in one process (a dict stands for the store) ----------------------------

class CountingStore:
    """A dict standing for the job's TCP store, counting requests."""

    def __init__(self):
        self.data, self.requests = {}, 0

    def set(self, key, value):
        self.requests += 1
        self.data[key] = value.encode() if isinstance(value, str) else value

    def get(self, key):
        self.requests += 1
        return self.data[key]

    def multi_get(self, keys):
        self.requests += 1
        return [self.data[k] for k in keys]


@pytest.mark.parametrize("world", [8, 2816])
def test_naming_the_ranks_that_left_costs_each_survivor_two_store_requests(world, monkeypatch):
    """Was 3N + 1 requests per survivor (one add per rank, twice, and a check per rank): at
    2,816 ranks, about 24 million in all when every survivor asks. Rank 5 died; odd ranks are
    still alive, even ranks gave up on their own."""
    store = CountingStore()
    beats = [Heartbeat(store, "p/", r, world) for r in range(world)]
    for b in beats:
        b._post("alive")
    for b in beats[2::2]:
        b.mark_aborted()
    alive = [b for b in beats[1::2] if b.rank != 5]
    moving_on = lambda s: [store.data.update({b.key(b.rank): b"alive:later"}) for b in alive]  # noqa: E731 (uncounted)
    monkeypatch.setattr(heartbeat.time, "sleep", moving_on)
    store.requests = 0
    assert beats[0].gone(wait_s=1) == [5]
    assert store.requests == 2


def test_a_rank_alive_but_unchanged_for_the_limit_is_lost_idle_and_aborted_ranks_are_not(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(heartbeat.time, "monotonic", lambda: clock[0])
    watch = heartbeat.Staleness(lost_after_s=10)
    stale = []
    for second in range(12):
        clock[0] = float(second)
        stale = watch.update({0: f"alive:{second}", 1: "alive:7", 2: "idle:3", 3: "aborted:4"})
    assert stale == [1]

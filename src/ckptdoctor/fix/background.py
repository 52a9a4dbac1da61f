"""Async saves: the training loop waits only for the host copy; the rest runs in the background.

Turned on with `install(accelerator, async_save=True)`, `ScalableCheckpointing(..., async_save=True)`
or CKPTDOCTOR_ASYNC=1 (settings.py). The protocol, every rank, with which thread does what:

  training thread                                   background thread (one per rank)
  1. wait for the save in flight, if any; its
     failure is raised here (the same on every
     rank: step 6 agreed on it)
  2. before the first async save: every rank
     checks the node's free host memory for the
     staging copy (host_memory.py), all refuse alike
  3. begin: rank 0 creates the staging directory
  4. Accelerate's save_state: each DCP save it
     makes is copied into this rank's reused host
     buffers (host_copy.py) and deferred; its small
     files (RNG states, ...) are written as stock
  5. every rank agrees that 3-4 succeeded (a
     failure anywhere: every rank raises now,
     nothing was deferred anywhere); commit hands
     the deferred saves to the background thread
     and save_state returns
                                                    6. the DCP saves, from the host copy, with our
                                                       planner and writer, then the barrier and rank 0's
                                                       publish: every step ends in a collective carrying
                                                       its outcome (agreement.py), so all ranks finish
                                                       with the same result
  The next checkpoint call (save_state, load_state, latest, begin, wait, end_training), the end of
  the process (atexit) and SIGTERM (when the trainer left its handler at the default) all do 1.

Why this way, and not DCP's own `async_save` as it is:
* every collective of step 6 runs on a gloo group of its own (`group`), made at construction with
  the checkpoint group's timeout: a training barrier, Accelerate's collectives and the next save's
  steps 2-5 run on other groups, so a background save and the training loop never share one
  (shared, they deadlock: collectives of two threads interleave in different orders on different ranks);
* one background thread runs the model's and the optimizer's saves in order. DCP's `async_save`
  starts a new one-thread executor per call, so Accelerate's two saves would run their plan
  exchanges concurrently on one group; its process executor makes its own gloo group with the
  default 30-minute timeout and plans with the stock planner: the hang this package fixes;
* nothing reaches the background until every rank has staged (step 5): if one rank failed in
  step 4 after staging the model, the others' queued optimizer save would wait for it for hours;
* DCP's own pieces are used where they fit: its `save` with our planner and writer runs step 6,
  and its `_create_cpu_state_dict` / `_copy_state_dict` (what its `BlockingAsyncStager` uses)
  make and fill the host copy.

A step counts only when step 6 published it (publish.py): until then it is an
`<name>.incomplete-<token>` directory that `latest()` and `load_state` never take, and a rank
killed during step 6 leaves the previous step loadable (the survivors leave by heartbeat.py's
rules); the next successful commit removes what the dead save left.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import datetime
import functools
import logging
import signal
import threading
import weakref

from .host_copy import HostCopies

log = logging.getLogger(__name__)
_LIVE: "weakref.WeakSet[Background]" = weakref.WeakSet()


class Background:
    """One rank's background saver: its group, its host copy, its one thread, the save in flight."""

    def __init__(self, timeout_s: float, alone: bool):
        import torch.distributed as dist

        self.group = None if alone else dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
        self.copies = HostCopies()
        self._thread = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckptdoctor-save")
        self._in_flight: concurrent.futures.Future | None = None
        self.deferred: list = []  # the DCP saves of the save being prepared (step 4)
        _LIVE.add(self)
        _wait_at_exit()

    def defer(self, name: str, save, state_dict, **kwargs) -> None:
        """Step 4, from the routed `dcp.save`: stage `state_dict` and keep the call for step 6."""
        self.deferred.append(functools.partial(save, self.copies.stage(name, state_dict), **kwargs))
        log.debug("ckptdoctor: staged %s: %d tensor(s), %d bytes held in all", name, self.copies.tensors(name),
                  self.copies.bytes)

    def take_deferred(self) -> list:
        taken, self.deferred = self.deferred, []
        return taken

    def start(self, job) -> None:
        """Step 5's end: `job` (step 6) runs on the background thread."""
        assert self._in_flight is None, "one save in flight: settle() first"
        self._in_flight = self._thread.submit(job)

    def in_flight(self) -> bool:
        return self._in_flight is not None and not self._in_flight.done()

    def settle(self) -> BaseException | None:
        """Step 1: wait for the save in flight; its failure (or None). Nothing is in flight after."""
        future, self._in_flight = self._in_flight, None
        if future is None:
            return None
        return future.exception()


@functools.cache
def _wait_at_exit() -> None:
    """Once per process: at normal exit and at SIGTERM (if left at the default), every rank's save
    in flight finishes first (its ranks all wait, so its collectives complete)."""
    atexit.register(_settle_all, "exit")
    if threading.current_thread() is threading.main_thread() and \
            signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
        signal.signal(signal.SIGTERM, _on_sigterm)


def _settle_all(why: str) -> None:
    for background in list(_LIVE):
        if background.in_flight():
            log.info("ckptdoctor: waiting for the save in flight before %s", why)
        failure = background.settle()
        if failure is not None:
            log.error("ckptdoctor: the save in flight failed: %s", failure)


def _on_sigterm(signum, frame) -> None:
    import os

    _settle_all("SIGTERM")
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)

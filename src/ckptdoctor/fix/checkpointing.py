"""Accelerate's save_state/load_state with the fix, published atomically, on a checkpoint group.

    from ckptdoctor import ScalableCheckpointing
    ckpt = ScalableCheckpointing(accelerator, timeout_s=3 * 3600)   # after accelerator.prepare, every rank
    ckpt.save_state(step_dir / "accelerator")                         # instead of accelerator.save_state
    ckpt.load_state(ckpt.latest(output_dir, "accelerator"))           # instead of accelerator.load_state

or, to publish a whole step directory (trainer state, weights and Accelerate state) at once:

    staging = ckpt.begin(save_path / f"step-{step}")   # every rank; the same staging dir everywhere
    ...                                                   # write anything into staging
    ckpt.save_state(staging / "accelerator")
    ckpt.commit(staging)                                 # every rank; step-<N> appears complete, or not at all

What it changes, and nothing else:
* a checkpoint process group (gloo, its own timeout): DCP's plan exchange, finish step and
  our barriers run there, so the training group's deadline can stay short and a long save
  cannot trip it;
* `ScalableSavePlanner` instead of the `DefaultSavePlanner()` Accelerate passes, and
  `ScalableFileSystemWriter` instead of its `FileSystemWriter(path)` (same files). A save rank 0
  cannot derive (ranks hold different keys) takes the planner's owned path by its own agreement;
* atomic publication (publish.py): everything is written to `<dir>.incomplete-<token>` and
  rank 0 renames it into place and marks it complete only when every DCP checkpoint in it has
  its `.metadata`; the next successful commit removes what dead saves left beside it (dead: begun
  before this ScalableCheckpointing was made, or failed in it; another job's later save is left
  alone). With
  `publish="in_place"` (object-store mounts) nothing is renamed: written in place, marked last;
* `latest()` runs on rank 0 and is broadcast: every rank resumes from the same step, the newest
  whose data files are whole, and every rank checks that it sees it complete (directory caching
  on NFS can differ between hosts);
* every DCP call Accelerate makes inside `save_state` is counted: a save that bypassed the fix
  (a `dcp.save` bound before this module ran, a planner it does not know) fails before publishing;
* a failure on any rank, in any step, is the same CheckpointAborted on every rank (agreement.py);
* heartbeats on the job's TCP store (heartbeat.py): when a rank dies, the others name it; when a
  rank stops answering without closing its connections (a lost node), rank 0 notices within
  `lost_rank_s` and every rank exits (EXIT_LOST_RANK) instead of waiting out the group timeout;
* with `async_save` (CKPTDOCTOR_ASYNC=1), `save_state` and `commit` return once every rank's state
  is copied into host memory; the DCP saves, the barrier and the publish run on a background
  thread and group, and every later checkpoint call waits for them first (background.py).

At construction, on every rank, in this order: the settings are resolved; an Accelerator that
already saves through ckptdoctor (`install` and `ScalableCheckpointing` on the same one: every
save would run the fix inside the fix) is refused with one line; the checkpoint group is made;
every rank's settings are compared with rank 0's and any difference stops the job on every rank,
naming the ranks and knobs (settings.py); every rank logs one line naming the integration and its
settings; and, with a save root (`save_root`, CKPTDOCTOR_SAVE_ROOT), rank 0 sets aside the step
directories dead saves left there (publish.py), so that the trainer's own scan, which runs next,
finds the newest complete step.

How: Accelerate calls `torch.distributed.checkpoint.save/load` with a fixed planner and no
process group. For the duration of one call only, those two module attributes are wrapped
(pass-through to torch's own functions: dcp_routing.py). This module is the orchestration:
which rank does what, in which order; the steps themselves live in publish.py (publish, tidy,
the newest loadable step), agreement.py, heartbeat.py and automatic_naming.py.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import time
from pathlib import Path

from ..errors import CkptDoctorError
from . import automatic_naming, dcp_failures
from .adapters import adapter_state_dict  # noqa: F401 - the MOVA patch imports it from here
from . import host_memory
from .agreement import OK, CheckpointAborted, aborted, alone, every_rank_agrees, rank0_decides
from .background import Background
from .compat import check_versions
from .dcp_routing import routed
from .heartbeat import Heartbeat, NoHeartbeat, exit_lost, job_store, log_lost, store_host
from .install import Routed, engine_of
from .load_check import prepare_for_load
from .settings import Settings
from .summary import OperationRecord, make_visible
from .publish import (Staging, complete_steps, new_token, newest_loadable, prepare, publish_and_tidy,
                      require_complete, set_aside_dead_steps)

log = logging.getLogger(__name__)
PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Connection refused")
OWNER = "_ckptdoctor_owner"  # set on an Accelerator by the ScalableCheckpointing that saves its state


class ScalableCheckpointing:
    """Owns the checkpoint group; saves and loads through Accelerate with the fix.

    `verify_replicas`: passed to the planner (check that replicated tensors hold the same
    values on every rank before saving them once). `lost_rank_s` / `on_lost_rank` ("exit" or
    "log"): what to do about a rank that stops answering. `timeout_s`, `lost_rank_s`,
    `on_lost_rank`, `heartbeat`, `log_level`, `publish` and `save_root` left as None come from the environment
    (settings.py), else their defaults (3 h, 300 s, "exit", "process", unchanged, "rename", none), so a
    patched trainer is tuned without edits. `integration`: what the startup line names (`install`
    passes "install").

    Every step that can fail on some ranks only ends in a collective carrying its outcome
    (agreement.py): a failure anywhere is the same CheckpointAborted on every rank."""

    def __init__(self, accelerator, timeout_s: float | None = None, group=None, *, verify_replicas=False,
                 lost_rank_s: float | None = None, on_lost_rank: str | None = None, heartbeat: str | None = None,
                 log_level: str | None = None, publish: str | None = None, save_root: str | os.PathLike | None = None,
                 async_save: bool | None = None, integration: str = "ScalableCheckpointing"):
        import torch.distributed as dist

        check_versions()
        engine = engine_of(accelerator)
        if engine is not None:  # the same on every rank: every rank refuses alike, nothing is saved
            raise CkptDoctorError(f"ScalableCheckpointing saves through DCP, and {engine}: keep this Accelerator's "
                                  f"own save_state (ckptdoctor.install leaves such an Accelerator stock)")
        self.settings = Settings.resolve(timeout_s=timeout_s, lost_rank_s=lost_rank_s, on_lost_rank=on_lost_rank,
                                         heartbeat=heartbeat, log_level=log_level, publish=publish, save_root=save_root,
                                         async_save=async_save)
        self.settings.apply_log_level()
        make_visible()
        refuse_a_second_integration(accelerator, integration)
        self.accelerator, self.integration = accelerator, integration
        # Accelerate's own methods, kept: install() puts this object's in their place on the instance
        self._accelerate_save_state, self._accelerate_load_state = accelerator.save_state, accelerator.load_state
        if alone(group):  # one process, no process group: no checkpoint group, no peers to watch
            self.group, self.rank, self.world_size = None, 0, 1
        else:
            self.group = group or dist.new_group(backend="gloo",
                                                 timeout=datetime.timedelta(seconds=self.settings.timeout_s))
            self.rank, self.world_size = dist.get_rank(self.group), dist.get_world_size(self.group)
        self._agree_on_settings()
        self._background = Background(self.settings.timeout_s, self.group is None) if self.settings.async_save else None
        self._pending: dict[Path, list] = {}  # staging directory -> its deferred DCP saves (async)
        if self._background is not None:
            self._accelerate_end_training = accelerator.end_training
            accelerator.end_training = Routed(accelerator, "end_training", self)  # the save in flight finishes first
        self.verify_replicas = verify_replicas
        self.heartbeat = self._heartbeat()
        self._open: dict[Path, Staging] = {}
        self._record = OperationRecord()
        setattr(accelerator, OWNER, self)
        log.info("ckptdoctor: rank %d of %d saves through %s: %s", self.rank, self.world_size, INTEGRATIONS[integration],
                 self.settings.describe())
        if self.settings.save_root is not None:
            self._rank0_decides("set aside incomplete steps", lambda: set_aside_dead_steps(Path(self.settings.save_root)))
        # what this job may remove as dead saves' leftovers: saves begun before now, and its own failed ones
        self._horizon, self._failed_tokens = new_token(), set()

    def __reduce__(self):
        """A copy of the Accelerator it serves (pickle, deepcopy) takes none of it along: the
        checkpoint group and the heartbeat belong to this process (install.Routed)."""
        return type(None), ()

    # -- publication ----------------------------------------------------------------------
    def begin(self, final_dir: str | os.PathLike) -> Path:
        """Every rank: open `final_dir` for writing; returns its staging directory (the same
        on every rank). Publish it with `commit`."""
        self._before_a_save()
        opened = Staging(Path(final_dir), self._start_operation(), self.settings.publish)
        staging = opened.staging()
        self._open[staging] = opened
        with self._aborting(staging):
            self._rank0_decides("create the staging directory", lambda: prepare(opened))
        return staging

    def commit(self, staging: str | os.PathLike) -> Path:
        """Every rank: publish `staging` as its final directory, or raise CheckpointAborted.
        After publishing, rank 0 removes what earlier saves left beside it (`remove_leftovers`)."""
        staging = Path(staging)
        opened = self._open.pop(staging)
        if self._background is None:
            self._finish(staging, opened, [], self.group)
        else:  # background.py, step 5's end: nothing of this save is left to the training thread
            self._record.stalled = time.monotonic() - self._record.started
            self._record.host_copy = self._background.copies.bytes
            saves = self._pending.pop(staging, [])
            self._background.start(lambda: self._finish(staging, opened, saves, self._background.group))
        return opened.final

    def _finish(self, staging: Path, opened: Staging, saves: list, group) -> None:
        """The DCP saves deferred to now (async), the barrier and rank 0's publish, on `group`."""
        try:
            if saves:
                self._every_rank_agrees("save_state (background)", lambda: [save() for save in saves], group)
            self._barrier("every rank wrote", group)
            save_root = None if self.settings.save_root is None else Path(self.settings.save_root)
            verdict = self._rank0_decides("publish", lambda: publish_and_tidy(staging, opened, save_root, self._horizon,
                                                                              self._failed_tokens), group)
            if verdict != OK:
                raise CheckpointAborted(f"{staging} was not published: {verdict}")
        except BaseException:
            self._failed_tokens.add(opened.token)
            self.heartbeat.stop(aborted=True)
            raise
        self.heartbeat.stop()
        self._record.ended = time.monotonic()
        if self.rank == 0:
            log.info(self._record.line("saved", opened.final))

    @contextlib.contextmanager
    def publishing(self, final_dir: str | os.PathLike):
        """`with ckpt.publishing(step_dir) as staging:` begin, the body, commit."""
        staging = self.begin(final_dir)
        with self._aborting(staging):
            yield staging
        self.commit(staging)

    # -- save / load ----------------------------------------------------------------------
    def save_state(self, output_dir: str | os.PathLike | None = None, **accelerate_kwargs) -> Path:
        """Accelerate's save_state with the fix (its other arguments passed on). Inside an open
        `begin`, it writes in place (published by `commit`); otherwise it publishes `output_dir`
        atomically itself. With Accelerate's automatic checkpoint naming, `output_dir` is ignored
        as stock ignores it, and `total_limit` applies after the commit (automatic_naming.py)."""
        if automatic_naming.enabled(self.accelerator):
            return self._save_automatically(accelerate_kwargs)
        if output_dir is None:
            raise CkptDoctorError("save_state() needs an output_dir, or Accelerate's automatic_checkpoint_naming in "
                                  "the project configuration; nothing was saved")
        target = Path(output_dir)
        opened = self._staging_of(target)
        if opened is not None:
            with self._aborting(opened.staging()):
                self._save(opened, target, accelerate_kwargs)
            return target
        with self.publishing(target) as staging:
            self._save(self._open[staging], staging, accelerate_kwargs)
        return target

    def _save_automatically(self, accelerate_kwargs: dict) -> Path:
        target = Path(self._rank0_decides("name the checkpoint",
                                          lambda: str(automatic_naming.next_directory(self.accelerator))))
        with automatic_naming.explicit_directory(self.accelerator):
            self.save_state(target, **accelerate_kwargs)
        limit = self.accelerator.project_configuration.total_limit
        if limit is not None:
            self._rank0_decides("apply total_limit", lambda: automatic_naming.remove_beyond_limit(target.parent, limit))
        return target

    def _save(self, opened: Staging, directory: Path, accelerate_kwargs: dict) -> None:
        def save():
            with routed(self.group, self.verify_replicas, self._record, opened, self._background):
                self._accelerate_save_state(str(directory), **accelerate_kwargs)
        try:
            self._every_rank_agrees("save_state", save)
        finally:  # async: what every rank staged waits for the commit; a failure anywhere drops it everywhere
            if self._background is not None:
                deferred = self._background.take_deferred()
                if opened.staging() in self._open:
                    self._pending.setdefault(opened.staging(), []).extend(deferred)

    def _before_a_save(self) -> None:
        """Every rank, before a save opens (background.py, steps 1-2): the save in flight settled;
        before the first async save, room in host memory for the copy."""
        self.wait()
        if self._background is None or self._background.copies.bytes:
            return
        need, (free, source) = host_memory.state_bytes(self.accelerator), host_memory.free_bytes()

        def check():
            short = host_memory.shortfall(need, host_memory.ranks_on_node(), free, source)
            if short:
                raise CkptDoctorError(short)
        self._every_rank_agrees("check host memory for the async copy", check)

    def wait(self) -> None:
        """Every rank: wait for the save in flight (async) to be published; raise its failure,
        the same CheckpointAborted on every rank. Without a save in flight, returns at once."""
        if self._background is None:
            return
        failure = self._background.settle()
        if failure is not None:
            raise aborted(f"the background save failed, nothing of it was published: {failure}",
                          getattr(failure, "also", None)) from failure

    def end_training(self, *args, **kwargs):
        """Accelerate's end_training (it destroys the process groups), after the save in flight."""
        self.wait()
        return self._accelerate_end_training(*args, **kwargs)

    def load_state(self, input_dir: str | os.PathLike | None = None, **accelerate_kwargs) -> None:
        """Accelerate's load_state with the fix, from a complete checkpoint only (every rank
        must see it complete; rank 0 checks its data files and index first). Without
        `input_dir`, with Accelerate's automatic checkpoint naming: the newest complete one."""
        self.wait()
        path = Path(input_dir) if input_dir is not None else self._newest_automatic()
        self._start_operation()
        try:
            self._every_rank_agrees("check the checkpoint", lambda: require_complete(path))
            verdict = self._rank0_decides("check the data files", lambda: prepare_for_load(path))
            if verdict != OK:
                raise CheckpointAborted(f"not loading {path}: {verdict}")
            self._every_rank_agrees("load_state", lambda: self._load(path, accelerate_kwargs))
        except BaseException:
            self.heartbeat.stop(aborted=True)
            raise
        self.heartbeat.stop()
        if self.rank == 0:
            log.info(self._record.line("loaded", path))

    def _newest_automatic(self) -> Path:
        if not automatic_naming.enabled(self.accelerator):
            raise CkptDoctorError("load_state() needs an input_dir, or Accelerate's automatic_checkpoint_naming in "
                                  "the project configuration; nothing was loaded")
        root = automatic_naming.checkpoints_dir(self.accelerator)
        newest = self.latest(root)
        if newest is None:
            raise CkptDoctorError(f"no complete checkpoint under {root}; nothing was loaded")
        return newest

    def _load(self, path: Path, accelerate_kwargs: dict) -> None:
        with routed(self.group, self.verify_replicas, self._record, None):
            try:
                self._accelerate_load_state(str(path), **accelerate_kwargs)
            except BaseException as error:
                failed = dcp_failures.per_rank(error)
                if isinstance(error, (KeyboardInterrupt, SystemExit, CkptDoctorError)) or not failed:
                    raise
                raise CheckpointAborted(f"loading {path} failed on rank(s) {', '.join(map(str, sorted(failed)))}: "
                                        f"{dcp_failures.first(error)}") from error

    def latest(self, root: str | os.PathLike, subdir: str | None = None, legacy: bool | None = None) -> Path | None:
        """Every rank: the newest checkpoint under `root` that is complete and loadable (its data
        files whole: see `newest_loadable`), as rank 0 sees it; raises CheckpointAborted if any
        rank does not see it complete. `legacy`: whether a whole stock save (no marker) counts;
        by default yes when publishing by rename, no in place (there only marked steps count)."""
        self.wait()
        legacy = self.settings.publish == "rename" if legacy is None else legacy
        choice = self._rank0_decides("find the latest checkpoint",
                                     lambda: str(newest_loadable(root, subdir, legacy) or ""))
        if not choice:
            stock = complete_steps(root, subdir, legacy=True) if not legacy and self.rank == 0 else []
            if stock:
                log.warning("ckptdoctor: no step under %s is marked complete; stock saves there (newest %s) are not "
                            "resumed from when publishing in place: pass legacy=True to latest() to count them",
                            root, stock[0])
            return None
        path = Path(choice)
        self._every_rank_agrees(f"see {path} complete", lambda: require_complete(path, legacy))
        return path

    @property
    def last_operation(self) -> OperationRecord:
        """The phases and bytes of the last save or load (what its INFO line reports)."""
        return self._record

    # -- internals ----------------------------------------------------------------------
    def _heartbeat(self):
        if self.group is None:
            return NoHeartbeat()
        lost = exit_lost if self.settings.on_lost_rank == "exit" else log_lost
        return Heartbeat(job_store(), f"ckptdoctor/{self.group.group_name}/", self.rank, self.world_size,
                         lost_after_s=self.settings.lost_rank_s, on_lost=lost,
                         use_process=self.settings.heartbeat == "process")

    def _agree_on_settings(self) -> None:
        """Every rank: compare its settings with rank 0's; any difference stops every rank."""
        rank0 = rank0_decides(self.group, "share rank 0's settings", self.settings.values)

        def compare():
            differ = self.settings.differences(rank0)
            if differ:
                raise CkptDoctorError(f"settings differ from rank 0's: {'; '.join(differ)} (set the same CKPTDOCTOR_* "
                                      f"variables and keywords on every node); nothing was written")
        every_rank_agrees(self.group, "agree on the settings", compare)

    def _staging_of(self, path: Path) -> "Staging | None":
        for staging, opened in self._open.items():
            if path == staging or staging in path.parents:
                return opened
        return None

    def _start_operation(self) -> str:
        """Every rank: a token for this save or load, chosen by rank 0 (which posts the
        heartbeat verdict key first), and this rank's heartbeat started."""
        token = None
        if self.rank == 0:
            token = new_token()
            self.heartbeat.open_verdict(token)
        self._record = OperationRecord()
        token = self._broadcast(token)
        self.heartbeat.start(token)
        return token

    def _broadcast(self, value):
        import torch.distributed as dist

        if self.group is None:
            return value
        box = [value]
        with self._step("broadcast"):
            dist.broadcast_object_list(box, src=dist.get_global_rank(self.group, 0), group=self.group)
        return box[0]

    def _rank0_decides(self, what: str, work, group=None):
        with self._step(what):
            return rank0_decides(self.group if group is None else group, what, work)

    def _every_rank_agrees(self, what: str, work, group=None):
        with self._step(what):
            return every_rank_agrees(self.group if group is None else group, what, work)

    @contextlib.contextmanager
    def _aborting(self, staging: Path):
        """On any error, the publication is dropped and this rank's heartbeat says it gave up."""
        try:
            yield
        except BaseException:
            opened = self._open.pop(staging, None)
            self._pending.pop(staging, None)
            if opened is not None:
                self._failed_tokens.add(opened.token)
            self.heartbeat.stop(aborted=True)
            raise

    def _barrier(self, what: str, group=None) -> None:
        import torch.distributed as dist

        if self.group is None:
            return
        with self._step(what):
            dist.barrier(group=self.group if group is None else group)

    @contextlib.contextmanager
    def _step(self, what: str):
        """Turn a peer's disappearance during `what` into one CheckpointAborted naming it; time it."""
        started = time.monotonic()
        try:
            yield
            self._record.add(what, time.monotonic() - started)
        except CkptDoctorError:
            raise
        except BaseException as error:  # DCP wraps per-rank failures in CheckpointException (a BaseException)
            if isinstance(error, (KeyboardInterrupt, SystemExit)) or not any(s in str(error) for s in PEER_GONE):
                raise
            self.heartbeat.mark_aborted()
            gone = self.heartbeat.gone()
            if self.heartbeat.store_lost:
                who = f"{store_host()} left the checkpoint"
            else:
                who = f"rank(s) {', '.join(map(str, gone))} left the checkpoint" if gone else "a peer left the checkpoint"
            raise CheckpointAborted(f"rank {self.rank}: checkpoint aborted at '{what}': {who} "
                                    f"({str(error).strip()[:200]})") from error


INTEGRATIONS = {"install": "ckptdoctor.install (level 1, one call after prepare)",
                "ScalableCheckpointing": "ScalableCheckpointing (level 2, the full patch or a trainer's own calls)"}


def refuse_a_second_integration(accelerator, integration: str) -> None:
    """Every rank, before any group exists: one ScalableCheckpointing per Accelerator. A second
    one would take the first one's save_state for Accelerate's and run the fix inside the fix."""
    existing = getattr(accelerator, OWNER, None)
    if existing is not None:
        raise CkptDoctorError(f"ckptdoctor: this Accelerator already saves through {INTEGRATIONS[existing.integration]}; "
                              f"refusing to add {INTEGRATIONS[integration]} as well: keep one of the two")

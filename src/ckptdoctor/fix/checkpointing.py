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
  cannot derive (ranks hold different keys) is retried at once on the planner's owned path;
* atomic publication: everything is written to `<dir>.incomplete-<token>` (a fresh name per
  attempt, chosen by rank 0); after every rank has written and every DCP checkpoint in it has
  its `.metadata`, rank 0 renames it to `<dir>`, then writes and fsyncs the completion marker
  (listing those checkpoints) and fsyncs the parent: on object-store mounts, where a directory
  rename copies object by object, a marker can only exist in a copy that is whole. A previous
  `<dir>` is moved aside first and removed only after the marker, so a crash never loses a step;
* `latest()` runs on rank 0 and is broadcast: every rank resumes from the same step, and every
  rank checks that it sees it complete (directory caching on NFS can differ between hosts);
* every DCP call Accelerate makes inside `save_state` is counted: a save that bypassed the fix
  (a `dcp.save` bound before this module ran, a planner it does not know) fails before publishing;
* heartbeats on the job's TCP store: when a rank dies, the others name it; when a rank stops
  answering without closing its connections (a lost node), rank 0 notices within
  `lost_rank_s` and every rank exits (EXIT_LOST_RANK) instead of waiting out the group timeout.

How: Accelerate calls `torch.distributed.checkpoint.save/load` with a fixed planner and no
process group. For the duration of one call only, those two module attributes are wrapped
(pass-through to torch's own functions). Checked on the versions in `compat.CHECKED`.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import json
import logging
import os
import re
import shutil
import sys
import threading
import time
from pathlib import Path

from ..errors import CkptDoctorError
from .compat import check_versions
from .index import (INDEX_NAME, METADATA_NAME, CorruptCheckpoint, NotIndexable, data_file_extents, read_index,
                    read_metadata_file, write_index)
from .load_planner import ScalableLoadPlanner
from .planner import NotDerivable, ScalableSavePlanner
from .storage import ScalableFileSystemReader, ScalableFileSystemWriter

log = logging.getLogger("ckptdoctor.checkpointing")
INCOMPLETE = ".incomplete-"
REPLACED = ".replaced-"
COMPLETE_MARKER = "CKPTDOCTOR_COMPLETE"
PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Connection refused")
HEARTBEAT_S = 1.0      # during a checkpoint each rank posts a heartbeat this often
LOST_RANK_S = 300.0    # a rank silent this long (with its connections open) is taken as lost
EXIT_LOST_RANK = 75    # the exit code when a rank is lost (EX_TEMPFAIL: the launcher may restart)


class CheckpointAborted(CkptDoctorError):
    """A save or load could not finish on every rank; nothing was published."""


class ScalableCheckpointing:
    """Owns the checkpoint group; saves and loads through Accelerate with the fix.

    `verify_replicas`: passed to the planner (check that replicated tensors hold the same
    values on every rank before saving them once). `lost_rank_s` / `on_lost_rank` ("exit" or
    "log"): what to do about a rank that stops answering."""

    def __init__(self, accelerator, timeout_s: float = 3 * 3600.0, group=None, *, verify_replicas=False,
                 lost_rank_s: float = LOST_RANK_S, on_lost_rank: str = "exit"):
        import torch.distributed as dist

        check_versions()
        if on_lost_rank not in ("exit", "log"):
            raise CkptDoctorError(f"on_lost_rank must be 'exit' or 'log', not {on_lost_rank!r}")
        self.accelerator = accelerator
        self.group = group or dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
        self.rank, self.world_size = dist.get_rank(self.group), dist.get_world_size(self.group)
        self.verify_replicas = verify_replicas
        self.heartbeat = Heartbeat(job_store(), f"ckptdoctor/{self.group.group_name}/", self.rank, self.world_size,
                                   lost_after_s=lost_rank_s, on_lost=_exit_lost if on_lost_rank == "exit" else _log_lost)
        self._open: dict[Path, _Staging] = {}

    # -- publication ----------------------------------------------------------------------
    def begin(self, final_dir: str | os.PathLike) -> Path:
        """Every rank: open `final_dir` for writing; returns its staging directory (the same
        on every rank). Publish it with `commit`."""
        final = Path(final_dir)
        token = self._start_operation()
        staging = final.with_name(f"{final.name}{INCOMPLETE}{token}")
        self._open[staging] = _Staging(final, token)
        if self.rank == 0:
            staging.mkdir(parents=True, exist_ok=True)  # a rank may already have made it (Accelerate does)
        self._barrier("create the staging directory")
        return staging

    def commit(self, staging: str | os.PathLike) -> Path:
        """Every rank: publish `staging` as its final directory, or raise CheckpointAborted."""
        staging = Path(staging)
        opened = self._open.pop(staging)
        try:
            self._barrier("every rank wrote")
            verdict = publish(staging, opened) if self.rank == 0 else None
            verdict = self._broadcast(verdict if self.rank == 0 else None)
            if verdict != "published":
                raise CheckpointAborted(f"rank {self.rank}: {staging} was not published: {verdict}")
            return opened.final
        finally:
            self.heartbeat.stop()

    @contextlib.contextmanager
    def publishing(self, final_dir: str | os.PathLike):
        """`with ckpt.publishing(step_dir) as staging:` begin, the body, commit."""
        staging = self.begin(final_dir)
        try:
            yield staging
        except BaseException:
            self._open.pop(staging, None)
            self.heartbeat.stop(aborted=True)
            raise
        self.commit(staging)

    # -- save / load ----------------------------------------------------------------------
    def save_state(self, output_dir: str | os.PathLike) -> Path:
        """Accelerate's save_state with the fix. Inside an open `begin`, it writes in place
        (published by `commit`); otherwise it publishes `output_dir` atomically itself."""
        target = Path(output_dir)
        opened = self._staging_of(target)
        if opened is not None:
            with self._step("save_state"), self._dcp_on_checkpoint_group(opened, target):
                self.accelerator.save_state(str(target))
            return target
        with self.publishing(target) as staging:
            with self._step("save_state"), self._dcp_on_checkpoint_group(self._open[staging], staging):
                self.accelerator.save_state(str(staging))
        return target

    def load_state(self, input_dir: str | os.PathLike) -> None:
        path = Path(input_dir)
        if not (is_complete(path) or is_complete(path.parent) or legacy_complete(path)):
            raise CheckpointAborted(f"{path} is not a complete checkpoint ({why_incomplete(path)}); refusing to load it")
        self._start_operation()
        try:
            verdict = self._broadcast(prepare_for_load(path) if self.rank == 0 else None)
            if verdict != "ok":
                raise CheckpointAborted(f"rank {self.rank}: not loading {path}: {verdict}")
            with self._step("load_state"), self._dcp_on_checkpoint_group(None, path):
                try:
                    self.accelerator.load_state(str(path))
                except BaseException as error:
                    if isinstance(error, (KeyboardInterrupt, SystemExit, CkptDoctorError)) or \
                            not hasattr(error, "failures"):
                        raise
                    raise CheckpointAborted(f"rank {self.rank}: loading {path} failed on rank(s) "
                                            f"{', '.join(map(str, sorted(error.failures)))}: "
                                            f"{_first_failure(error)}") from error
        except BaseException:
            self.heartbeat.stop(aborted=True)
            raise
        self.heartbeat.stop()

    def latest(self, root: str | os.PathLike, subdir: str | None = None, legacy: bool = True) -> Path | None:
        """Every rank: the newest complete checkpoint under `root` (see `find_latest`), as rank 0
        sees it; raises CheckpointAborted if any rank does not see it complete."""
        import torch
        import torch.distributed as dist

        choice = self._broadcast(str(find_latest(root, subdir, legacy) or "") if self.rank == 0 else None)
        if not choice:
            return None
        path = Path(choice)
        seen = torch.tensor([int(path.is_dir() and (is_complete(path) or is_complete(path.parent) or
                                                     (legacy and legacy_complete(path))))])
        everyone = [torch.zeros(1, dtype=seen.dtype) for _ in range(self.world_size)]
        dist.all_gather(everyone, seen, group=self.group)
        blind = [r for r, ok in enumerate(everyone) if not int(ok)]
        if blind:
            raise CheckpointAborted(f"rank 0 chose {path} to resume from, but rank(s) {', '.join(map(str, blind))} "
                                    f"do not see it complete (a shared filesystem's caching?); not resuming")
        return path

    # -- internals ----------------------------------------------------------------------
    def _staging_of(self, path: Path) -> "_Staging | None":
        for staging, opened in self._open.items():
            if path == staging or staging in path.parents:
                return opened
        return None

    def _start_operation(self) -> str:
        """Every rank: a token for this save or load, chosen by rank 0 (which posts the
        heartbeat verdict key first), and this rank's heartbeat started."""
        token = None
        if self.rank == 0:
            token = f"{time.time_ns():x}{os.getpid():x}"
            self.heartbeat.open_verdict(token)
        token = self._broadcast(token)
        self.heartbeat.start(token)
        return token

    def _broadcast(self, value):
        import torch.distributed as dist

        box = [value]
        with self._step("broadcast"):
            dist.broadcast_object_list(box, src=dist.get_global_rank(self.group, 0), group=self.group)
        return box[0]

    def _barrier(self, what: str) -> None:
        import torch.distributed as dist

        with self._step(what):
            dist.barrier(group=self.group)

    @contextlib.contextmanager
    def _step(self, what: str):
        """Turn a peer's disappearance during `what` into one CheckpointAborted naming it."""
        try:
            yield
        except CkptDoctorError:
            raise
        except BaseException as error:  # DCP wraps per-rank failures in CheckpointException (a BaseException)
            if isinstance(error, (KeyboardInterrupt, SystemExit)) or not any(s in str(error) for s in PEER_GONE):
                raise
            self.heartbeat.mark_aborted()
            gone = self.heartbeat.gone()
            who = f"rank(s) {', '.join(map(str, gone))} left the checkpoint" if gone else "a peer left the checkpoint"
            raise CheckpointAborted(f"rank {self.rank}: checkpoint aborted at '{what}': {who} "
                                    f"({str(error).strip()[:200]})") from error

    @contextlib.contextmanager
    def _dcp_on_checkpoint_group(self, opened: "_Staging | None", root: Path):
        """For one call: Accelerate's dist_cp.save/load run on the checkpoint group, saves with
        the planner and writer; every call is counted and its directory recorded. Restored on
        exit, also on error."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner, FileSystemReader, FileSystemWriter

        original_save, original_load = dcp.save, dcp.load
        group, verify = self.group, self.verify_replicas

        @functools.wraps(original_save)
        def save(state_dict, *, checkpoint_id=None, storage_writer=None, planner=None, process_group=None, **kwargs):
            if planner is not None and type(planner) is not DefaultSavePlanner and not isinstance(planner, ScalableSavePlanner):
                raise CheckpointAborted(f"Accelerate passed a {type(planner).__name__}; ckptdoctor replaces only "
                                        f"DefaultSavePlanner, so this save would not be the fix's")
            if type(storage_writer) is FileSystemWriter:  # a subclass without state of its own: same settings
                storage_writer.__class__ = ScalableFileSystemWriter
            elif storage_writer is None and checkpoint_id is not None:
                storage_writer = ScalableFileSystemWriter(checkpoint_id)
            if opened is not None:
                opened.checkpoints.append(_relative(getattr(storage_writer, "path", checkpoint_id), opened))
            kwargs |= dict(checkpoint_id=checkpoint_id, storage_writer=storage_writer,
                           process_group=process_group or group)
            try:
                return original_save(state_dict, planner=ScalableSavePlanner(verify_replicas=verify), **kwargs)
            except BaseException as error:
                if not _failed_with(error, NotDerivable):
                    raise
                log.warning("ckptdoctor: rank 0 could not derive this save's metadata (%s); saving on the owned path",
                            _first_failure(error))
                return original_save(state_dict, planner=ScalableSavePlanner(derive_metadata=False,
                                                                             verify_replicas=verify), **kwargs)

        @functools.wraps(original_load)
        def load(state_dict, *, checkpoint_id=None, storage_reader=None, planner=None, process_group=None,
                 **kwargs):
            if planner is not None and type(planner) is not DefaultLoadPlanner:
                raise CheckpointAborted(f"Accelerate passed a {type(planner).__name__}; ckptdoctor replaces only "
                                        f"DefaultLoadPlanner, so this load would not be the fix's")
            if type(storage_reader) is FileSystemReader:  # a subclass without state of its own: same settings
                storage_reader.__class__ = ScalableFileSystemReader
            elif storage_reader is None and checkpoint_id is not None:
                storage_reader = ScalableFileSystemReader(checkpoint_id)
            options = {} if planner is None else dict(flatten_state_dict=planner.flatten_state_dict,
                                                      flatten_sharded_tensors=planner.flatten_sharded_tensors,
                                                      allow_partial_load=planner.allow_partial_load)
            return original_load(state_dict, checkpoint_id=checkpoint_id, storage_reader=storage_reader,
                                 planner=ScalableLoadPlanner(**options), process_group=process_group or group,
                                 **kwargs)

        dcp.save, dcp.load = save, load
        try:
            yield
        finally:
            dcp.save, dcp.load = original_save, original_load


class _Staging:
    """One open publication: its final name, token, and the DCP checkpoints saved into it."""

    def __init__(self, final: Path, token: str):
        self.final, self.token = final, token
        self.checkpoints: list[str] = []   # saved through the fix, relative to the staging directory

    def staging(self) -> Path:
        return self.final.with_name(f"{self.final.name}{INCOMPLETE}{self.token}")


def _relative(path, opened: _Staging) -> str:
    return str(Path(path).resolve().relative_to(opened.staging().resolve()))


def _failed_with(error: BaseException, kind: type) -> bool:
    """Whether a DCP CheckpointException (or the error itself) carries a `kind` failure."""
    failures = getattr(error, "failures", None)
    if isinstance(failures, dict):
        return any(isinstance(f[0] if isinstance(f, tuple) else f, kind) for f in failures.values())
    return isinstance(error, kind)


def _first_failure(error: BaseException) -> str:
    failures = getattr(error, "failures", {}) or {}
    first = next(iter(failures.values()), error)
    return str(first[0] if isinstance(first, tuple) else first)


def publish(staging: Path, opened: _Staging) -> str:
    """Rank 0: check the staging directory, rename it into place, then write and fsync the
    marker and fsync the parent. Returns "published" or why not (nothing renamed then)."""
    missing = [c for c in opened.checkpoints if not (staging / c / ".metadata").is_file()]
    if missing:
        return f"DCP checkpoint(s) {', '.join(missing)} have no .metadata"
    unwrapped = sorted(str(m.parent.relative_to(staging)) for m in staging.rglob(".metadata")
                       if str(m.parent.relative_to(staging)) not in opened.checkpoints)
    if unwrapped:
        return (f"DCP checkpoint(s) {', '.join(unwrapped)} were saved without ckptdoctor's planner (a dcp.save bound "
                f"before ckptdoctor wrapped it?)")
    final = opened.final
    replaced = final.with_name(f"{final.name}{REPLACED}{opened.token}") if final.exists() else None
    if replaced is not None:
        os.replace(final, replaced)  # kept whole until the new one is marked complete
    os.replace(staging, final)
    marker = final / COMPLETE_MARKER
    with open(marker, "w") as f:
        json.dump({"token": opened.token, "dcp_checkpoints": opened.checkpoints, "time": time.time()}, f)
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(final)
    _fsync_dir(final.parent)
    if replaced is not None:
        shutil.rmtree(replaced, ignore_errors=True)
    return "published"


def prepare_for_load(state_dir: Path) -> str:
    """Rank 0, before a load: every DCP checkpoint in `state_dir` has its index (made now, once,
    for a checkpoint stock DCP wrote) and every data file its chunks need, whole. Returns "ok" or
    the first problem, naming the file."""
    checkpoints = sorted(d for d in Path(state_dir).iterdir() if d.is_dir() and
                         ((d / METADATA_NAME).exists() or (d / INDEX_NAME).exists() or
                          d.name.startswith(("pytorch_model_fsdp_", "optimizer_"))))
    try:
        for directory in checkpoints:
            for name, extent in data_file_extents(_indexed(directory)).items():
                file = directory / name
                if not file.is_file():
                    return f"{file} is missing"
                if file.stat().st_size < extent:
                    return f"{file} is truncated: {file.stat().st_size} bytes, its chunks reach {extent}"
    except CorruptCheckpoint as problem:
        return str(problem)
    return "ok"


def _indexed(directory: Path):
    """The checkpoint's storage index: from its index file, made now if it has none (a stock
    checkpoint: one unpickle of .metadata here instead of one on every rank), or, where no index
    can be written, the unpickled .metadata's own."""
    metadata = read_index(directory)
    if metadata is not None:
        return metadata.storage_data
    stock = read_metadata_file(directory)
    try:
        write_index(directory, stock)
    except (OSError, NotIndexable) as reason:  # read-only, or chunks the index has no column for
        log.info("ckptdoctor: %s stays without an index (%s): every rank reads its .metadata", directory, reason)
        return stock.storage_data
    return read_index(directory).storage_data


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# -- what counts as a checkpoint ----------------------------------------------------------------

def is_complete(path: Path) -> bool:
    """Published by ckptdoctor: its marker, and every DCP checkpoint the marker lists has its
    `.metadata`. A staging directory never counts."""
    path = Path(path)
    if INCOMPLETE in path.name:
        return False
    try:
        marker = json.loads((path / COMPLETE_MARKER).read_text())
    except (OSError, ValueError):
        return False
    return all((path / c / ".metadata").is_file() for c in marker.get("dcp_checkpoints", []))


def legacy_complete(path: Path) -> bool:
    """Saved by stock `accelerator.save_state` (no marker) and whole: in its Accelerate
    directory (`path` or `path/accelerator`) every model and optimizer DCP checkpoint has its
    `.metadata`, and rank 0's random states (written after them) exist."""
    path = Path(path)
    if INCOMPLETE in path.name or (path / COMPLETE_MARKER).exists():
        return False
    state = path if any(path.glob("pytorch_model_fsdp_*")) else path / "accelerator"
    models, optimizers = list(state.glob("pytorch_model_fsdp_*")), list(state.glob("optimizer_*"))
    return bool(models and optimizers) and all((d / ".metadata").is_file() for d in models + optimizers) and \
        (state / "random_states_0.pkl").is_file()


def why_incomplete(path: Path) -> str:
    """What keeps `path` (an Accelerate state directory, or the step directory holding one) from
    counting as a checkpoint, naming the file."""
    path = Path(path)
    if INCOMPLETE in path.name or INCOMPLETE in path.parent.name:
        return "a staging directory: its save did not finish"
    for marked in (path, path.parent):
        if (marked / COMPLETE_MARKER).is_file():
            try:
                listed = json.loads((marked / COMPLETE_MARKER).read_text()).get("dcp_checkpoints", [])
            except ValueError:
                return f"{marked / COMPLETE_MARKER} is unreadable"
            missing = [marked / c / METADATA_NAME for c in listed if not (marked / c / METADATA_NAME).is_file()]
            return f"{missing[0]} is missing" if missing else "complete"
    state = path if any(path.glob("pytorch_model_fsdp_*")) else path / "accelerator"
    needed = [d / METADATA_NAME for d in sorted(state.glob("pytorch_model_fsdp_*")) + sorted(state.glob("optimizer_*"))]
    missing = [f for f in needed + [state / "random_states_0.pkl"] if not f.is_file()]
    if not needed:
        return f"no {COMPLETE_MARKER} in {path}, and no model or optimizer checkpoint in {state}"
    return f"{missing[0]} is missing" if missing else "complete"


STEP_NAME = re.compile(r"^(?P<base>\D*?)(?P<step>\d+)(?P<replaced>" + re.escape(REPLACED) + r"[0-9a-f]+)?$")


def find_latest(root, subdir: str | None = None, legacy: bool = True) -> Path | None:
    """The newest complete `root/<name><N>[/subdir]` (names like `step-200`), this process's
    view. A step whose directory was moved aside by a re-save that did not finish is found
    under its `.replaced-` name; staging directories never count."""
    root = Path(root)
    if not root.is_dir():
        return None
    best = None
    for entry in root.iterdir():
        match = STEP_NAME.match(entry.name)
        if not match or not entry.is_dir():
            continue
        for path in _candidates(entry, subdir):
            if is_complete(path) or (legacy and legacy_complete(path)):
                rank = (int(match["step"]), match["replaced"] is None and REPLACED not in path.name)
                if best is None or rank > best[0]:
                    best = (rank, path)
                break
    return None if best is None else best[1]


def _candidates(entry: Path, subdir: str | None) -> list[Path]:
    if subdir is None:
        return [entry]
    return [entry / subdir] + sorted(entry.glob(f"{subdir}{REPLACED}*"))


# -- heartbeats ---------------------------------------------------------------------------------

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
                 lost_after_s: float = LOST_RANK_S, on_lost=None):
        self.store, self.prefix, self.rank, self.world_size = store, prefix, rank, world_size
        self.interval_s, self.lost_after_s = interval_s, lost_after_s
        self.on_lost = on_lost or _log_lost
        self.seq = 0
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._post("idle")  # every key exists before any checkpoint: reading them never blocks

    def key(self, rank: int) -> str:
        return f"{self.prefix}beat/{rank}"

    def _post(self, state: str) -> None:
        self.seq += 1
        self.store.set(self.key(self.rank), f"{state}:{self.seq}")

    def open_verdict(self, token: str) -> None:
        """Rank 0, before it tells the others `token`: the key they will read exists."""
        self.store.set(f"{self.prefix}verdict/{token}", "ok")

    def start(self, token: str) -> None:
        """Every rank, after a collective every rank took part in (the token broadcast)."""
        self.stop()
        self.verdict_key = f"{self.prefix}verdict/{token}"
        self._post("alive")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ckptdoctor-heartbeat", daemon=True)
        self._thread.start()

    def stop(self, aborted: bool = False) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join(timeout=5)
            self._thread = None
        self._post("aborted" if aborted else "idle")

    def mark_aborted(self) -> None:
        """This rank gives up on its own: not a rank that disappeared."""
        self.store.set(self.key(self.rank), f"aborted:{self.seq}")

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
                if verdict != "ok":
                    self.on_lost(self.rank, verdict)
                    return
        except Exception as error:  # noqa: BLE001 - the store went away: rank 0's process or the agent
            self.on_lost(self.rank, f"the job's store is unreachable ({str(error).strip()[:120]}): rank 0 or the "
                                    f"launcher's agent is gone")

    def gone(self, wait_s: float | None = None) -> list[int]:
        """Ranks that disappeared: alive but unchanged over `wait_s`, and not aborted on their
        own. Two requests however many ranks there are."""
        wait_s = 3 * self.interval_s if wait_s is None else wait_s
        keys = [self.key(r) for r in range(self.world_size)]
        try:
            before = [v.decode() for v in self.store.multi_get(keys)]
            time.sleep(wait_s)
            after = [v.decode() for v in self.store.multi_get(keys)]
        except Exception:  # noqa: BLE001
            return []
        return [r for r in range(self.world_size) if r != self.rank and after[r] == before[r]
                and after[r].startswith("alive:")]


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


def _log_lost(rank: int, verdict: str) -> None:
    log.error("ckptdoctor: rank %d: %s; the checkpoint cannot finish", rank, verdict)


def _exit_lost(rank: int, verdict: str) -> None:
    """A collective waiting for a lost rank cannot be interrupted (gloo's abort does not wake
    it): leave, with a distinct exit code, so the launcher restarts the job. Nothing was
    published: the staging directory is never renamed."""
    message = f"ckptdoctor: rank {rank}: {verdict}; exiting with code {EXIT_LOST_RANK} (nothing was published)"
    log.error(message)
    print(message, file=sys.stderr, flush=True)
    os._exit(EXIT_LOST_RANK)


# -- LoRA weights without a full-model gather ---------------------------------------------------

def adapter_state_dict(model, marker: str = "lora_") -> dict:
    """The adapter (LoRA) weights, full, on every rank, without gathering the rest of the model.

    Call on every rank (sharded adapters are all-gathered, one tensor at a time, in parameter
    order). FSDP-sharded parameters (DTensors) are gathered; plain ones (FSDP-ignored) are this
    rank's copy: nothing in FSDP keeps those equal across ranks unless the trainer averages
    their gradients itself (check with `verify_replicas`). Keys are the model's parameter
    names, as in `accelerator.get_state_dict(model)`."""
    state = {}
    for name, param in model.named_parameters():
        if marker in name:
            full = param.full_tensor() if hasattr(param, "full_tensor") else param
            state[name] = full.detach().cpu().clone()
    if not state:
        raise CkptDoctorError(f"no parameter name contains {marker!r}")
    return state

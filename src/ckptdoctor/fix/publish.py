"""The publish protocol: a checkpoint directory counts as complete only once it is whole.

Two modes (`Settings.publish`, CKPTDOCTOR_PUBLISH):

* "rename" (default): everything is written to `<dir>.incomplete-<token>` (a fresh name per
  attempt). Rank 0 then checks it, renames it to `<dir>`, writes and fsyncs the completion
  marker (listing the DCP checkpoints in it) and fsyncs the parent. A previous `<dir>` is moved
  aside first and removed only after the marker, so a crash never loses a step.
* "in_place", for object-store mounts (OBS/s3 FUSE), where a directory rename copies the data
  object by object while every other rank waits: no rename. Rank 0 first writes a `WRITING`
  file (its token) into `<dir>`; an existing `<dir>` loses its marker next, then its contents
  (re-saving a step replaces it: if that save fails, the step is gone, earlier ones are not).
  Every rank writes in place; rank 0 writes the marker last, only after every DCP checkpoint has
  its `.metadata`.

In both modes rank 0 writes the `WRITING` file before any rank writes, and removes it after the
marker: a directory with a `WRITING` file and no marker (a save that died, even one renamed
into place just before its marker) never counts, not even as a whole stock save, and the next
successful save beside it removes it.

What counts as a checkpoint (`is_complete`, `legacy_complete` for stock saves) and which is the
newest (`find_latest`, and `newest_loadable`: complete and its data files whole) live here too:
they are the reading side of the same protocol. So does rank 0's tidying after a publish
(`publish_and_tidy`).

A trainer that makes its own step directories and calls `save_state` inside them (MOVA:
`step-N/trainer_state.pt`, then `save_state(step-N/accelerator)`) publishes only the Accelerate
directory; when a save dies, `step-N` stays, and the trainer's own scan for its newest step would
pick it and stop on it at every restart (or, when it died before `trainer_state.pt`, silently
start again from step 0). So at startup, when the trainer's save root is known
(`Settings.save_root`), rank 0 sets such steps aside before the trainer scans
(`set_aside_incomplete_steps`): every `<name><N>` directory there that holds no checkpoint,
neither itself nor a directory inside it, is renamed `<name><N>.incomplete-<token>`. Nothing is
deleted then; the next successful save removes it with the other leftovers, which it looks for
beside the directory it published, in the save root, and inside each step directory there.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
from pathlib import Path

from .accelerate_layout import MODEL_PREFIX, RANK0_RNG_STATES, dcp_directories, state_directory
from .agreement import OK, CheckpointAborted
from .index import METADATA_NAME
from .load_check import prepare_for_load

log = logging.getLogger(__name__)
INCOMPLETE = ".incomplete-"
REPLACED = ".replaced-"
COMPLETE_MARKER = "CKPTDOCTOR_COMPLETE"
WRITING_MARKER = "CKPTDOCTOR_WRITING"
MODES = ("rename", "in_place")


class Staging:
    """One open publication: its final name, token, mode, and the DCP checkpoints saved into it."""

    def __init__(self, final: Path, token: str, mode: str = "rename"):
        self.final, self.token, self.mode = final, token, mode
        self.checkpoints: list[str] = []   # saved through the fix, relative to the staging directory

    def staging(self) -> Path:
        """Where every rank writes: a fresh name beside the final one, or (in place) the final one."""
        if self.mode == "in_place":
            return self.final
        return self.final.with_name(f"{self.final.name}{INCOMPLETE}{self.token}")


def prepare(opened: Staging) -> None:
    """Rank 0, before any rank writes: create the directory every rank writes into. In place, an
    existing directory is claimed (WRITING file), unmarked, then emptied, in that order."""
    target = opened.staging()
    target.mkdir(parents=True, exist_ok=True)
    _write_durably(target / WRITING_MARKER, {"token": opened.token, "time": time.time()})
    if opened.mode == "rename":
        return
    if (target / COMPLETE_MARKER).exists():
        _remove_durably(target / COMPLETE_MARKER)  # from here on the old step no longer counts
    for entry in sorted(target.iterdir()):
        if entry.name != WRITING_MARKER:
            _remove_entry(entry)


def publish(staging: Path, opened: Staging) -> str:
    """Rank 0: check what every rank wrote, then make it count: rename it into place and mark
    it (rename mode), or mark it where it is (in place). Returns OK or why not (then
    nothing new counts)."""
    problem = _unpublishable(staging, opened)
    if problem:
        return problem
    if opened.mode == "in_place":
        _write_durably(staging / COMPLETE_MARKER, _marker(opened))
        _remove_durably(staging / WRITING_MARKER)  # a crash before this leaves a marked, complete step
        return OK
    final = opened.final
    replaced = final.with_name(f"{final.name}{REPLACED}{opened.token}") if final.exists() else None
    if replaced is not None:
        os.replace(final, replaced)  # kept whole until the new one is marked complete
    os.replace(staging, final)
    _write_durably(final / COMPLETE_MARKER, _marker(opened))
    _remove_durably(final / WRITING_MARKER)
    fsync_directory(final.parent)
    if replaced is not None:
        shutil.rmtree(replaced, ignore_errors=True)
    return OK


def _unpublishable(staging: Path, opened: Staging) -> str | None:
    missing = [c for c in opened.checkpoints if not (staging / c / METADATA_NAME).is_file()]
    if missing:
        return f"DCP checkpoint(s) {', '.join(missing)} have no .metadata"
    unwrapped = sorted(str(m.parent.relative_to(staging)) for m in staging.rglob(METADATA_NAME)
                       if str(m.parent.relative_to(staging)) not in opened.checkpoints)
    if unwrapped:
        return (f"DCP checkpoint(s) {', '.join(unwrapped)} were saved without ckptdoctor's planner (a dcp.save bound "
                f"before ckptdoctor wrapped it?)")
    return None


def _marker(opened: Staging) -> dict:
    return {"token": opened.token, "dcp_checkpoints": opened.checkpoints, "mode": opened.mode, "time": time.time()}


def _write_durably(path: Path, data: dict) -> None:
    """Write, flush and fsync a small JSON file, then fsync its directory."""
    with open(path, "w") as f:
        json.dump(data, f)
        f.flush()
        os.fsync(f.fileno())
    fsync_directory(path.parent)


def _remove_entry(entry: Path) -> None:
    shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()


def _remove_durably(path: Path) -> None:
    path.unlink(missing_ok=True)
    fsync_directory(path.parent)


def fsync_directory(path: Path) -> None:
    """Make a directory's entries durable (the selftest checks that the file system allows it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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
    return all((path / c / METADATA_NAME).is_file() for c in marker.get("dcp_checkpoints", []))


def legacy_complete(path: Path) -> bool:
    """Saved by stock `accelerator.save_state` (no marker) and whole: in its Accelerate
    directory (`path` or `path/accelerator`) every model and optimizer DCP checkpoint has its
    `.metadata`, and rank 0's random states (written after them) exist."""
    path = Path(path)
    if INCOMPLETE in path.name or (path / COMPLETE_MARKER).exists():
        return False
    state = state_directory(path)
    if _being_written(path) or _being_written(state):
        return False
    checkpoints = dcp_directories(state)
    has_both = {d.name.startswith(MODEL_PREFIX) for d in checkpoints} == {True, False}
    return has_both and all((d / METADATA_NAME).is_file() for d in checkpoints) and (state / RANK0_RNG_STATES).is_file()


def why_incomplete(path: Path) -> str:
    """What keeps `path` (an Accelerate state directory, or the step directory holding one) from
    counting as a checkpoint, naming the file."""
    path = Path(path)
    if INCOMPLETE in path.name or INCOMPLETE in path.parent.name:
        return "a staging directory: its save did not finish"
    if _being_written(path) and not (path / COMPLETE_MARKER).is_file():
        return f"{WRITING_MARKER} and no {COMPLETE_MARKER}: saved in place, the save did not finish"
    for marked in (path, path.parent):
        if (marked / COMPLETE_MARKER).is_file():
            try:
                listed = json.loads((marked / COMPLETE_MARKER).read_text()).get("dcp_checkpoints", [])
            except ValueError:
                return f"{marked / COMPLETE_MARKER} is unreadable"
            missing = [marked / c / METADATA_NAME for c in listed if not (marked / c / METADATA_NAME).is_file()]
            return f"{missing[0]} is missing" if missing else "complete"
    state = state_directory(path)
    needed = [d / METADATA_NAME for d in dcp_directories(state)]
    missing = [f for f in needed + [state / RANK0_RNG_STATES] if not f.is_file()]
    if not needed:
        return f"no {COMPLETE_MARKER} in {path}, and no model or optimizer checkpoint in {state}"
    return f"{missing[0]} is missing" if missing else "complete"


def counts_as_checkpoint(path: Path, legacy: bool = True) -> bool:
    """What `load_state` accepts: a directory published whole (its own marker, or its step
    directory's marker listing DCP checkpoints inside it), or, with `legacy`, a whole stock save."""
    path = Path(path)
    if not path.is_dir():
        return False
    return is_complete(path) or (is_complete(path.parent) and _listed_in_marker(path)) or \
        (legacy and legacy_complete(path))


def _being_written(path: Path) -> bool:
    """An in-place save wrote here (`path` or its step directory) and has not marked it."""
    return any((p / WRITING_MARKER).exists() and not (p / COMPLETE_MARKER).exists() for p in (path, path.parent))


def _listed_in_marker(path: Path) -> bool:
    listed = json.loads((path.parent / COMPLETE_MARKER).read_text()).get("dcp_checkpoints", [])
    return any(c.startswith(f"{path.name}/") for c in listed)


# Any name ending in the step number: step-200, v2-step-200, global_step200.
STEP_NAME = re.compile(r"^(?P<base>.*?)(?P<step>\d+)(?P<replaced>" + re.escape(REPLACED) + r"[0-9a-f]+)?$")


def complete_steps(root, subdir: str | None = None, legacy: bool = True) -> list[Path]:
    """Every complete `root/<name><N>[/subdir]`, newest first, in this process's view. A step
    whose directory was moved aside by a re-save that did not finish is found under its
    `.replaced-` name, after the step itself; staging directories never count."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        match = STEP_NAME.match(entry.name)
        if not match or not entry.is_dir() or INCOMPLETE in entry.name:
            continue
        for path in _candidates(entry, subdir):
            if counts_as_checkpoint(path, legacy):
                found.append(((int(match["step"]), match["replaced"] is None and REPLACED not in path.name), path))
                break
    return [path for _, path in sorted(found, key=lambda item: item[0], reverse=True)]


def find_latest(root, subdir: str | None = None, legacy: bool = True) -> Path | None:
    """The newest of `complete_steps`, or None."""
    steps = complete_steps(root, subdir, legacy)
    return steps[0] if steps else None


def _candidates(entry: Path, subdir: str | None) -> list[Path]:
    if subdir is None:
        return [entry]
    return [entry / subdir] + sorted(entry.glob(f"{subdir}{REPLACED}*"))


# -- leftovers ------------------------------------------------------------------------------------

def new_token() -> str:
    """A save's token: its start time (16 hex digits of ns) and rank 0's pid."""
    return f"{time.time_ns():016x}{os.getpid():x}"


def token_time_ns(token: str) -> int | None:
    try:
        return int(token[:16], 16) if len(token) > 16 else None
    except ValueError:
        return None


LEFTOVER = re.compile(r"^(?P<name>.+?)(?P<kind>" + re.escape(INCOMPLETE) + "|" + re.escape(REPLACED) +
                      r")(?P<token>[0-9a-f]+)$")


def remove_leftovers(root: Path, horizon: str, dead: frozenset[str] | set[str] = frozenset()) -> list[Path]:
    """Rank 0, after a save published into `root`: remove what dead saves left there. A save is
    dead when it started before `horizon` (the time this job's checkpointing began: a save of this
    job's earlier run, or of anything before it) or its token is in `dead` (this job's own saves
    that failed). A save that started later, and is not this job's, may be live (another job
    sharing the save root) and is left alone. So are a `.replaced-` copy whose step is not complete
    again (it is that step's only copy) and anything not named like our own leftovers. The dead
    are: staging directories (`.incomplete-<token>`) and unmarked directories an in-place save
    claimed (their WRITING file's token)."""
    def is_dead(token: str) -> bool:
        when, until = token_time_ns(token), token_time_ns(horizon)
        return token in dead or (when is not None and until is not None and when < until)

    removed = []
    for entry in sorted(Path(root).iterdir()):
        match = LEFTOVER.match(entry.name)
        claimed = _claimed_by(entry) if entry.is_dir() else None
        if claimed is not None and is_dead(claimed):
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
            continue
        if not match or not entry.is_dir():
            continue
        if match["kind"] == INCOMPLETE:
            gone = is_dead(match["token"])
        else:
            gone = counts_as_checkpoint(entry.with_name(match["name"]))
        if gone:
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
    return removed


def leftover_places(final: Path, save_root: Path | None) -> list[Path]:
    """Where a save that published `final` looks for earlier saves' leftovers: beside `final`,
    and, when `final` sits in a step directory (`<root>/step-N/accelerator`) or a save root is
    given, in that root and inside each of its step directories."""
    places = [final.parent]
    root = save_root or (final.parent.parent if STEP_NAME.match(final.parent.name) else None)
    if root is not None and Path(root).is_dir():
        places.append(Path(root))
        places += [entry for entry in sorted(Path(root).iterdir()) if entry.is_dir() and _is_step(entry)]
    return list(dict.fromkeys(Path(p) for p in places))


def set_aside_incomplete_steps(root: Path, token: str) -> list[tuple[Path, Path]]:
    """Rank 0, at startup, before the trainer looks for its newest step under `root`: rename each
    step directory that a save died in to `<name>.incomplete-<token>`, out of the trainer's sight.
    Returns (old, new) pairs. A step counts as one a save died in when it holds no checkpoint
    (neither itself nor a directory inside it: a whole stock save counts, and so does a step
    being replaced, by its `.replaced-` copy) and it is named like the root's checkpoints (the
    same name before the number as a step that holds one) or holds a save's traces (a staging
    or replaced directory, a WRITING file). Any other directory is not the trainer's and stays."""
    root = Path(root)
    if not root.is_dir():
        return []
    steps = [entry for entry in sorted(root.iterdir()) if entry.is_dir() and _is_step(entry)]
    complete = {entry: _holds_a_checkpoint(entry) for entry in steps}
    bases = {STEP_NAME.match(entry.name)["base"] for entry, whole in complete.items() if whole}
    moved = []
    for entry, whole in complete.items():
        if whole or not (STEP_NAME.match(entry.name)["base"] in bases or _holds_traces(entry)):
            continue
        aside = entry.with_name(f"{entry.name}{INCOMPLETE}{token}")
        os.replace(entry, aside)
        moved.append((entry, aside))
    if moved:
        fsync_directory(root)
    return moved


def _holds_traces(step: Path) -> bool:
    return any(INCOMPLETE in p.name or REPLACED in p.name or p.name == WRITING_MARKER
               for p in [*step.iterdir(), *(q for sub in step.iterdir() if sub.is_dir() for q in sub.iterdir())])


def _is_step(entry: Path) -> bool:
    """A step directory's own name: ends in its number, and is no staging or replaced copy."""
    return bool(STEP_NAME.match(entry.name)) and INCOMPLETE not in entry.name and REPLACED not in entry.name


def _holds_a_checkpoint(step: Path) -> bool:
    return counts_as_checkpoint(step) or any(counts_as_checkpoint(sub) for sub in step.iterdir() if sub.is_dir())


def _claimed_by(entry: Path) -> str | None:
    """The token of the in-place save that claimed `entry` (its WRITING file) and did not mark it."""
    if (entry / COMPLETE_MARKER).exists():
        return None
    try:
        return str(json.loads((entry / WRITING_MARKER).read_text())["token"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


# -- rank 0's side of a save and a resume: publish and tidy, the newest loadable step, dead steps set aside

def require_complete(path: Path, legacy: bool = True) -> None:
    if not counts_as_checkpoint(path, legacy):
        raise CheckpointAborted(f"{path} is not a complete checkpoint ({why_incomplete(path)}); refusing to load it")


def set_aside_dead_steps(save_root: Path) -> int:
    """Rank 0, at startup: the step directories dead saves left under `save_root`, renamed out of
    the trainer's sight (publish.py), each named in a warning."""
    moved = set_aside_incomplete_steps(save_root, new_token())
    for step, aside in moved:
        log.warning("ckptdoctor: %s holds no complete checkpoint (a save died in it: %s); set it aside as %s, so "
                    "that the trainer resumes from its newest complete step; the next successful save removes it",
                    step, why_step_incomplete(step), aside.name)
    return len(moved)


def why_step_incomplete(step: Path) -> str:
    subs = [sub for sub in sorted(step.iterdir()) if sub.is_dir() and "." not in sub.name] if step.is_dir() else []
    return "; ".join(f"{sub.name}: {why_incomplete(sub)}" for sub in subs) or "nothing of a checkpoint in it"


def publish_and_tidy(staging: Path, opened: Staging, save_root: Path | None = None, horizon: str | None = None,
                     dead: set[str] = frozenset()) -> str:
    """Rank 0: publish, then remove what dead saves left beside it, in the save root and in its
    step directories (a failure there is logged: the step is published). Dead: begun before
    `horizon` (default: this save's start) or listed in `dead` (publish.remove_leftovers)."""
    verdict = publish(staging, opened)
    if verdict != OK:
        return verdict
    for place in leftover_places(opened.final, save_root):
        try:
            for leftover in remove_leftovers(place, horizon or opened.token, dead):
                log.info("ckptdoctor: removed %s, left by an earlier save", leftover)
        except OSError as error:
            log.warning("ckptdoctor: could not remove earlier saves' leftovers in %s: %s", place, error)
    return verdict


def newest_loadable(root, subdir: str | None = None, legacy: bool = True) -> Path | None:
    """Rank 0: the newest complete checkpoint whose data files are whole (`prepare_for_load`);
    a step that is marked complete but lost files since is skipped, with a warning, so that an
    auto-restarting job resumes from the step before it instead of failing on it forever."""
    for path in complete_steps(root, subdir, legacy):
        problem = prepare_for_load(path)
        if problem == OK:
            return path
        log.warning("ckptdoctor: not resuming from %s: %s; trying the step before it", path, problem)
    return None

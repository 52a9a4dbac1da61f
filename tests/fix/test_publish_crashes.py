"""The publish protocol, crashed at each of its file-system steps, in both modes.

One process, real DCP checkpoints (ScalableFileSystemWriter), real files. A save is: rank 0
prepares the directory every rank writes into, the DCP checkpoint is written, the step's own
file beside it, rank 0 publishes and tidies. The crash is INJECTED: the k-th call to one of the
protocol's file-system operations (or DCP's finish, where `.metadata` is written) raises instead
of running, for k = 1, 2, ... until a save runs through. After each crash: what `latest` would
pick is a step whose data load back with that step's values, and a retried save publishes."""

import json
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from ckptdoctor.fix import publish as publishing
from ckptdoctor.fix.agreement import OK
from ckptdoctor.fix.publish import newest_loadable, publish_and_tidy
from ckptdoctor.fix.publish import COMPLETE_MARKER, STEP_NAME, WRITING_MARKER, Staging, new_token, prepare
from ckptdoctor.fix.storage import ScalableFileSystemReader, ScalableFileSystemWriter


class Crash(BaseException):
    """The node died here (a BaseException: nothing on the way may swallow it)."""


class CrashAt:
    """Counts calls to the protocol's file-system operations; the k-th raises Crash."""

    OPERATIONS = [(publishing.os, "replace"), (publishing.shutil, "rmtree"), (publishing, "_write_durably"),
                  (publishing, "_remove_durably"), (publishing, "_remove_entry"), (publishing, "fsync_directory"),
                  (ScalableFileSystemWriter, "finish")]

    def __init__(self, monkeypatch, k):
        self.k, self.calls = k, []
        for owner, name in self.OPERATIONS:
            monkeypatch.setattr(owner, name, self._counted(name, getattr(owner, name)))

    def _counted(self, name, real):
        def call(*args, **kwargs):
            if name == "replace":  # DCP renames its .metadata.tmp file; rename mode, directories
                self.calls.append("replace dir" if Path(args[0]).is_dir() else "replace file")
            else:
                self.calls.append(name)
            if len(self.calls) == self.k:
                raise Crash(name)
            return real(*args, **kwargs)
        return call


def save(root, step, value, mode):
    """One whole save of `step`: the directory, two DCP checkpoints holding `value` and the files
    of a whole stock save (so that an unmarked one would pass for it), the trainer's file."""
    opened = Staging(root / f"step-{step}", new_token(), mode)
    prepare(opened)
    for name in ("pytorch_model_fsdp_0", "optimizer_0"):  # what Accelerate's save_state writes, in its order
        dcp.save({"w": torch.full((16,), float(value))},
                 storage_writer=ScalableFileSystemWriter(opened.staging() / "accelerator" / name))
        opened.checkpoints.append(f"accelerator/{name}")
    (opened.staging() / "accelerator" / "random_states_0.pkl").write_bytes(b"r")  # whole, as a stock save
    (opened.staging() / "trainer_state.json").write_text(json.dumps({"step": step}))
    assert publish_and_tidy(opened.staging(), opened) == OK


def loaded_value(step_dir) -> float:
    state = {"w": torch.zeros(16)}
    dcp.load(state, storage_reader=ScalableFileSystemReader(step_dir / "accelerator" / "optimizer_0"))
    assert torch.equal(state["w"], torch.full((16,), state["w"][0].item()))
    return state["w"][0].item()


def crash_matrix(tmp_path, monkeypatch, mode, resave):
    """[(k, operation that crashed, what latest picked, its value)] until a save ran through."""
    outcomes = []
    for k in range(1, 40):
        root = tmp_path / f"{mode}-{resave}-{k}"
        save(root, 1, 1.0, mode)
        new_step, new_value = (1, 3.0) if resave else (2, 2.0)
        with monkeypatch.context() as patched:
            crash = CrashAt(patched, k)
            try:
                save(root, new_step, new_value, mode)
            except BaseException:  # Crash, or DCP's CheckpointException wrapping it
                if len(crash.calls) < k:
                    raise
                crashed = crash.calls[k - 1]
            else:
                return outcomes
        latest = newest_loadable(root, legacy=False)
        value = None if latest is None else loaded_value(latest)
        outcomes.append((k, crashed, latest and latest.name, value))
        assert newest_loadable(root, legacy=True) == latest, "an unmarked directory counted as a stock save"
        if latest is not None:  # never a mix: the step it names (or its copy moved aside) holds that step's values
            step = int(STEP_NAME.match(latest.name)["step"])
            assert (step, value) in {(1, 1.0), (new_step, new_value)}, outcomes[-1]
            assert json.loads((latest / "trainer_state.json").read_text())["step"] == step
        save(root, new_step, new_value, mode)  # the retry publishes, and leaves nothing of the crash
        assert loaded_value(newest_loadable(root, legacy=False)) == new_value
        assert sorted(p.name for p in root.iterdir()) == sorted({"step-1", f"step-{new_step}"}), crash.calls
        assert not any(root.rglob(WRITING_MARKER))
    raise AssertionError("the save never ran through")


@pytest.mark.parametrize("mode", ["rename", "in_place"])
def test_a_crash_at_any_step_of_a_new_steps_save_leaves_the_previous_step_or_the_new_one_whole(
        tmp_path, monkeypatch, mode):
    outcomes = crash_matrix(tmp_path, monkeypatch, mode, resave=False)
    assert len(outcomes) >= 3, outcomes  # the matrix reached the publish steps
    assert all(latest in ("step-1", "step-2") for _, _, latest, _ in outcomes), outcomes
    assert outcomes[0][2] == "step-1" and outcomes[-1][2] == "step-2", outcomes  # early crash: old; last: new
    if mode == "in_place":
        assert not any(op == "replace dir" for _, op, _, _ in outcomes), "in place, no directory is renamed"


def test_a_crashed_resave_by_rename_always_keeps_one_whole_copy_of_the_step(tmp_path, monkeypatch):
    outcomes = crash_matrix(tmp_path, monkeypatch, "rename", resave=True)
    assert all(latest is not None for _, _, latest, _ in outcomes), outcomes


def test_a_crashed_resave_in_place_loses_only_that_step_and_never_counts_a_mix(tmp_path, monkeypatch):
    """The documented cost of writing in place: re-saving an existing step unmarks it first."""
    outcomes = crash_matrix(tmp_path, monkeypatch, "in_place", resave=True)
    assert outcomes[0][1:] == ("_write_durably", "step-1", 1.0)  # claimed, not yet unmarked: the old step
    assert any(latest is None for _, _, latest, _ in outcomes), outcomes  # once unmarked, until marked again


def test_in_place_the_marker_is_written_only_after_every_metadata_and_the_writing_file_goes_last(
        tmp_path, monkeypatch):
    root = tmp_path / "root"
    save(root, 1, 1.0, "in_place")
    with monkeypatch.context() as patched:
        crash = CrashAt(patched, 0)  # counts, never crashes
        save(root, 2, 2.0, "in_place")
    assert crash.calls == ["_write_durably", "fsync_directory",  # WRITING, before any rank writes
                           "finish", "replace file", "finish", "replace file",  # DCP's two .metadata files
                           "_write_durably", "fsync_directory",  # the marker
                           "_remove_durably", "fsync_directory"], crash.calls  # WRITING removed
    step = root / "step-2"
    assert json.loads((step / COMPLETE_MARKER).read_text())["mode"] == "in_place"
    assert not (step / WRITING_MARKER).exists() and (step / "accelerator" / "optimizer_0" / ".metadata").is_file()

"""The publish protocol (fix/publish.py), in one process: staging, rename, marker, what counts as a
checkpoint, the newest loadable step, dead steps set aside and leftovers removed."""

import json
import os
import re

import pytest
import torch

from ckptdoctor.fix import publish as publishing
from ckptdoctor.fix.agreement import OK
from ckptdoctor.fix.publish import newest_loadable, publish_and_tidy
from ckptdoctor.fix.publish import (COMPLETE_MARKER, INCOMPLETE, REPLACED, WRITING_MARKER, Staging, counts_as_checkpoint,
                                    find_latest, is_complete, legacy_complete, new_token, publish)
from ckptdoctor.fix.storage import ScalableFileSystemWriter


def dcp_dir(path, metadata=True):
    path.mkdir(parents=True, exist_ok=True)
    (path / "__0_0.distcp").write_bytes(b"x")
    if metadata:
        (path / ".metadata").write_bytes(b"m")
    return path


def staged(root, name="step-1", token="ab12", checkpoints=("accelerator/optimizer_0",)):
    """A staging directory holding DCP checkpoints, and its open publication."""
    opened = Staging(root / name, token)
    for c in checkpoints:
        dcp_dir(opened.staging() / c)
        opened.checkpoints.append(c)
    return opened.staging(), opened


def test_publish_renames_then_marks_and_the_result_counts(tmp_path):
    staging, opened = staged(tmp_path)
    assert publish(staging, opened) == OK
    final = tmp_path / "step-1"
    assert not staging.exists() and is_complete(final)
    assert json.loads((final / COMPLETE_MARKER).read_text())["dcp_checkpoints"] == ["accelerator/optimizer_0"]


def test_the_marker_is_written_after_the_rename_never_inside_a_staging_directory(tmp_path, monkeypatch):
    """On an object-store mount a directory rename copies object by object: a marker copied
    with a partial directory would publish it. So at rename time no marker may exist."""
    staging, opened = staged(tmp_path)
    seen = []
    real_replace = os.replace
    monkeypatch.setattr(publishing.os, "replace",
                        lambda a, b: (seen.append((a, (a / COMPLETE_MARKER).exists())), real_replace(a, b))[1])
    publish(staging, opened)
    assert seen == [(staging, False)]


def test_a_crash_between_moving_the_old_step_aside_and_the_new_marker_loses_no_step(tmp_path, monkeypatch):
    old, old_opened = staged(tmp_path, token="0001")
    publish(old, old_opened)  # step-1, complete
    new, new_opened = staged(tmp_path, token="0002")
    real_replace = os.replace
    calls = []

    def crash_on_second(a, b):
        calls.append(a)
        if len(calls) == 2:
            raise OSError("the node died here")
        return real_replace(a, b)
    monkeypatch.setattr(publishing.os, "replace", crash_on_second)
    with pytest.raises(OSError):
        publish(new, new_opened)
    assert not (tmp_path / "step-1").exists()  # moved aside ...
    assert find_latest(tmp_path) == tmp_path / f"step-1{REPLACED}0002"  # ... and still found, complete


def test_publish_refuses_a_missing_metadata_and_a_dcp_save_that_bypassed_the_fix(tmp_path):
    staging, opened = staged(tmp_path)
    (staging / "accelerator/optimizer_0/.metadata").unlink()
    assert "have no .metadata" in publish(staging, opened)
    staging, opened = staged(tmp_path, name="step-2")
    dcp_dir(staging / "accelerator" / "pytorch_model_fsdp_0")  # saved, but not through the wrapper
    assert "saved without ckptdoctor's planner" in publish(staging, opened)
    assert not (tmp_path / "step-1").exists() and not (tmp_path / "step-2").exists()  # nothing renamed


def test_what_counts_marker_and_every_listed_metadata_or_a_whole_stock_save(tmp_path):
    staging, opened = staged(tmp_path, checkpoints=("accelerator/pytorch_model_fsdp_0", "accelerator/optimizer_0"))
    publish(staging, opened)
    step = tmp_path / "step-1"
    assert is_complete(step)
    (step / "accelerator/optimizer_0/.metadata").unlink()
    assert not is_complete(step)  # a marker alone does not count
    stock = tmp_path / "step-5" / "accelerator"
    dcp_dir(stock / "pytorch_model_fsdp_0")
    dcp_dir(stock / "optimizer_0")
    assert not legacy_complete(stock)  # no random states yet: save_state had not finished
    (stock / "random_states_0.pkl").write_bytes(b"r")
    assert legacy_complete(stock) and legacy_complete(stock.parent)
    (stock / "optimizer_0/.metadata").unlink()
    assert not legacy_complete(stock)


def test_find_latest_skips_staging_and_incomplete_steps(tmp_path):
    for step in (100, 200):
        staging, opened = staged(tmp_path, name=f"step-{step}", token=f"{step:x}")
        publish(staging, opened)
    staged(tmp_path, name="step-300")  # never committed
    unmarked = tmp_path / "step-400"
    dcp_dir(unmarked / "accelerator/optimizer_0")  # a stock save that died: no random states
    assert find_latest(tmp_path) == tmp_path / "step-200"
    assert find_latest(tmp_path, legacy=False) == tmp_path / "step-200"
    assert find_latest(tmp_path / "missing") is None
    assert all(INCOMPLETE not in p.name for p in tmp_path.iterdir() if is_complete(p))


def test_a_step_published_with_begin_and_commit_is_found_by_its_accelerate_subdirectory(tmp_path):
    """commit() marks the step directory, not step/accelerator: latest(root, "accelerator") used to
    skip such steps unless the legacy test happened to pass."""
    staging, opened = staged(tmp_path, name="step-4", token="0004",
                             checkpoints=("accelerator/pytorch_model_fsdp_0", "accelerator/optimizer_0"))
    publish(staging, opened)
    assert find_latest(tmp_path, "accelerator", legacy=False) == tmp_path / "step-4" / "accelerator"
    assert not counts_as_checkpoint(tmp_path / "step-4" / "acelerator")  # a misspelt subdirectory is not one
    staged_v2, opened_v2 = staged(tmp_path, name="v2-step-8", token="0008")
    publish(staged_v2, opened_v2)
    assert find_latest(tmp_path, legacy=False) == tmp_path / "v2-step-8"  # digits before the step number


def real_step(root, step, token):
    """A published step whose Accelerate state holds a real single-process DCP checkpoint."""
    import torch.distributed.checkpoint as dcp

    opened = Staging(root / f"step-{step}", token)
    dcp.save({"w": torch.full((16,), float(step))},
             storage_writer=ScalableFileSystemWriter(opened.staging() / "accelerator" / "optimizer_0"))
    opened.checkpoints.append("accelerator/optimizer_0")
    assert publish(opened.staging(), opened) == OK
    return root / f"step-{step}"


def test_latest_skips_a_step_whose_data_files_are_gone_and_takes_the_one_before(tmp_path):
    older, newer = real_step(tmp_path, 100, new_token()), real_step(tmp_path, 200, new_token())
    assert newest_loadable(tmp_path) == newer
    next((newer / "accelerator" / "optimizer_0").glob("*.distcp")).unlink()
    assert find_latest(tmp_path) == newer  # still marked complete ...
    assert newest_loadable(tmp_path) == older  # ... but not loadable: the job resumes from the step before


def test_the_next_successful_commit_removes_earlier_saves_leftovers_and_nothing_it_may_need(tmp_path):
    dead_staging = tmp_path / f"step-100{INCOMPLETE}{new_token()}"
    dead_staging.mkdir()
    kept_replaced = real_step(tmp_path, 50, new_token()).with_name(f"step-60{REPLACED}{new_token()}")
    kept_replaced.mkdir()  # step-60 exists nowhere else: its only copy stays
    redundant = tmp_path / f"step-50{REPLACED}{new_token()}"
    redundant.mkdir()  # step-50 is complete again: the copy goes
    ours = new_token()
    later_staging = tmp_path / f"step-300{INCOMPLETE}{new_token()}"  # started after ours: may be live
    later_staging.mkdir()
    opened = Staging(tmp_path / "step-200", ours)
    dcp_dir(opened.staging() / "accelerator" / "optimizer_0")
    opened.checkpoints.append("accelerator/optimizer_0")
    assert publish_and_tidy(opened.staging(), opened) == OK
    assert not dead_staging.exists() and not redundant.exists()
    assert kept_replaced.exists() and later_staging.exists() and is_complete(tmp_path / "step-200")


# -- level 1 (install): the trainer's own step directories -----------------------------------------


def level1_step(root, step, token, complete=True):
    """`<root>/step-N/` as MOVA leaves it at level 1: its own files, then install's published
    `accelerator` (complete) or a dead save's staging beside an empty `accelerator` (not)."""
    directory = root / f"step-{step}"
    directory.mkdir(parents=True)
    (directory / "trainer_state.pt").write_bytes(b"state")
    opened = Staging(directory / "accelerator", token)
    dcp_dir(opened.staging() / "optimizer_0", metadata=complete)
    opened.checkpoints.append("optimizer_0")
    if complete:
        assert publish(opened.staging(), opened) == OK
    else:
        (directory / "accelerator").mkdir()  # MOVA makes it before calling save_state
    return directory


def test_at_startup_a_step_a_save_died_in_is_set_aside_and_the_trainers_scan_finds_the_newest_complete(tmp_path):
    from ckptdoctor.fix.publish import set_aside_dead_steps

    good = level1_step(tmp_path, 4, new_token())
    dead = level1_step(tmp_path, 8, new_token(), complete=False)  # died in save_state: trainer_state.pt is there
    (tmp_path / "step-12" / "video_dit").mkdir(parents=True)  # died before trainer_state.pt (MOVA's own weights)
    stock = tmp_path / "step-2" / "accelerator"  # a whole stock save (before the fix): a checkpoint
    for name in ("pytorch_model_fsdp_0", "optimizer_0"):
        dcp_dir(stock / name)
    (stock / "random_states_0.pkl").write_bytes(b"r")
    (tmp_path / "logs-2026").mkdir()  # not named like the steps, no trace of a save: not the trainer's
    (tmp_path / "final").mkdir()
    assert set_aside_dead_steps(tmp_path) == 2
    names = sorted(p.name for p in tmp_path.iterdir())
    assert [n for n in names if n.startswith("step-") and INCOMPLETE not in n] == ["step-2", "step-4"]
    assert {n.split(INCOMPLETE)[0] for n in names if INCOMPLETE in n} == {"step-8", "step-12"}
    assert "logs-2026" in names and "final" in names and good.exists() and not dead.exists()
    moved = next(tmp_path.glob(f"step-8{INCOMPLETE}*"))
    assert (moved / "trainer_state.pt").read_bytes() == b"state"  # set aside, nothing deleted
    # MOVA's own scan (accelerate_trainer.py:111-135): the newest `step-N` directory
    steps = [int(m[1]) for p in tmp_path.iterdir() if (m := re.fullmatch(r"step-(\d+)", p.name)) and p.is_dir()]
    assert max(steps) == 4
    assert set_aside_dead_steps(tmp_path) == 0  # a second start finds nothing more


def test_a_first_save_that_died_with_no_step_complete_yet_is_set_aside_by_its_traces_alone(tmp_path):
    from ckptdoctor.fix.publish import set_aside_dead_steps

    level1_step(tmp_path, 4, new_token(), complete=False)
    (tmp_path / "run-7").mkdir()  # someone else's directory: no checkpoint, no trace
    assert set_aside_dead_steps(tmp_path) == 1
    assert sorted(p.name.split(INCOMPLETE)[0] for p in tmp_path.iterdir()) == ["run-7", "step-4"]
    assert not (tmp_path / "step-4").exists()


def test_the_next_save_removes_level1_leftovers_in_the_save_root_and_inside_its_steps(tmp_path):
    """Level 1 publishes `step-N/accelerator`: a dead save's staging sits inside its step, and a
    step set aside sits in the save root; both are beside no directory the next save publishes."""
    from ckptdoctor.fix.publish import set_aside_dead_steps

    level1_step(tmp_path, 4, new_token())
    stale = level1_step(tmp_path, 8, new_token(), complete=False)
    set_aside_dead_steps(tmp_path)
    inner = level1_step(tmp_path, 12, new_token())
    dead_inner = inner / f"accelerator{INCOMPLETE}{new_token()}"  # an earlier attempt at step-12, died
    dcp_dir(dead_inner / "optimizer_0")
    (tmp_path / "step-16").mkdir()
    opened = Staging(tmp_path / "step-16" / "accelerator", new_token())
    later = tmp_path / "step-20" / f"accelerator{INCOMPLETE}{new_token()}"  # started after ours: may be live
    later.mkdir(parents=True)
    dcp_dir(opened.staging() / "optimizer_0")
    opened.checkpoints.append("optimizer_0")
    assert publish_and_tidy(opened.staging(), opened) == OK
    leftovers = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if INCOMPLETE in p.name)
    assert leftovers == [str(later.relative_to(tmp_path))]
    assert not stale.exists() and is_complete(inner / "accelerator") and is_complete(tmp_path / "step-16" / "accelerator")


def test_an_in_place_save_a_dead_job_left_is_removed_and_a_live_ones_is_not(tmp_path):
    """In place, a step being written is the step itself: removing the wrong one deletes data.
    Dead: claimed (WRITING, no marker) before this job's checkpointing began, or by a save of this
    job that failed. A save claimed later is another job's, maybe live; a marked step is a step."""
    from ckptdoctor.fix.publish import remove_leftovers

    def claimed(name, token, marked=False):
        directory = tmp_path / name
        dcp_dir(directory / "accelerator" / "optimizer_0")
        (directory / WRITING_MARKER).write_text(json.dumps({"token": token}))
        if marked:
            (directory / COMPLETE_MARKER).write_text(json.dumps({"token": token, "dcp_checkpoints": []}))
        return directory

    before, failed_here = new_token(), new_token()
    dead = claimed("step-100", before)
    horizon = new_token()
    ours_failed = claimed("step-200", failed_here)  # began before the horizon too, but named as failed: gone anyway
    live = claimed("step-300", new_token())  # another job's, begun after this job's checkpointing began
    marked = claimed("step-50", before, marked=True)
    assert sorted(p.name for p in remove_leftovers(tmp_path, horizon, {failed_here})) == ["step-100", "step-200"]
    assert not dead.exists() and not ours_failed.exists() and live.exists() and marked.exists()
    assert (live / "accelerator" / "optimizer_0" / ".metadata").is_file()

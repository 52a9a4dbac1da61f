"""Accelerate's automatic checkpoint naming with `total_limit`, through `install`
(fix/automatic_naming.py): the same names and counter as stock, the limit applied only after a
publish, `load_state()` taking the newest complete checkpoint.

In-process, as a trainer is debugged and as Accelerate's own tests run: no launcher, no process
group (tests/support/one_process.py). Each test compares against what stock Accelerate does in
the same situation; the same on two ranks: tests/fix/test_install.py."""

import pytest
import torch

accelerate = pytest.importorskip("accelerate")

from ckptdoctor.errors import CkptDoctorError  # noqa: E402
from ckptdoctor.fix.agreement import CheckpointAborted  # noqa: E402
from ckptdoctor.fix.publish import COMPLETE_MARKER, INCOMPLETE  # noqa: E402

from support.one_process import names, one_process_accelerator, step, weights  # noqa: E402,F401 (the fixture `make`)


def test_automatic_names_and_counter_are_stocks(make, tmp_path):
    dirs = {}
    for fix in (False, True):
        accelerator, model, optimizer, _ = make(fix=fix, automatic_checkpoint_naming=True)
        for _ in range(3):
            accelerator.save_state()
        dirs[fix] = (names(tmp_path / ("ours" if fix else "stock") / "checkpoints"), accelerator.save_iteration)
    assert dirs[True] == dirs[False] == (["checkpoint_0", "checkpoint_1", "checkpoint_2"], 3)


def test_total_limit_keeps_k_complete_checkpoints_where_a_failed_save_leaves_stock_k_minus_1(make, tmp_path):
    complete = {}
    for fix in (False, True):
        accelerator, model, optimizer, extra = make(fix=fix, automatic_checkpoint_naming=True, total_limit=2)
        for value in (1.0, 2.0, 3.0):
            step(model, optimizer, value)
            accelerator.save_state()
        extra.broken = True
        with pytest.raises((RuntimeError, CheckpointAborted), match="disk quota exceeded"):
            accelerator.save_state()
        root = tmp_path / ("ours" if fix else "stock") / "checkpoints"
        complete[fix] = sorted(p.name for p in root.iterdir()
                               if INCOMPLETE not in p.name and (p / "custom_checkpoint_0.pkl").exists())
    assert complete[False] == ["checkpoint_2"]                     # stock deleted checkpoint_1 before failing
    assert complete[True] == ["checkpoint_1", "checkpoint_2"]      # ours removes only after a publish


def test_total_limit_applies_after_each_publish(make, tmp_path):
    accelerator, model, optimizer, _ = make(fix=True, automatic_checkpoint_naming=True, total_limit=2)
    for _ in range(5):
        accelerator.save_state()
    root = tmp_path / "ours" / "checkpoints"
    assert names(root) == ["checkpoint_3", "checkpoint_4"]
    assert all((root / name / COMPLETE_MARKER).is_file() for name in names(root))


def test_load_state_without_a_directory_loads_the_newest_complete_checkpoint(make, tmp_path):
    accelerator, model, optimizer, _ = make(fix=True, automatic_checkpoint_naming=True)
    step(model, optimizer, 1.0)
    accelerator.save_state()
    step(model, optimizer, 2.0)
    accelerator.save_state()
    newest = weights(model)
    root = tmp_path / "ours" / "checkpoints"
    (root / "checkpoint_7").mkdir()  # a newer folder a dead stock save left: stock would load it
    (root / "checkpoint_7" / "model.safetensors").write_bytes(b"truncated")
    step(model, optimizer, 3.0)
    accelerator.load_state()
    assert all(torch.equal(a, b) for a, b in zip(weights(model), newest))


def test_load_state_without_a_directory_and_no_complete_checkpoint_is_one_line(make, tmp_path):
    accelerator, *_ = make(fix=True, automatic_checkpoint_naming=True)
    (tmp_path / "ours" / "checkpoints").mkdir(parents=True)
    with pytest.raises(CkptDoctorError, match=r"^no complete checkpoint under .*checkpoints; nothing was loaded$"):
        accelerator.load_state()


def test_an_existing_automatic_name_is_refused_and_nothing_is_saved(make, tmp_path):
    accelerator, *_ = make(fix=True, automatic_checkpoint_naming=True)
    (tmp_path / "ours" / "checkpoints" / "checkpoint_0").mkdir(parents=True)
    with pytest.raises(CheckpointAborted, match=r"checkpoint_0 \(0\) already exists.*nothing was saved"):
        accelerator.save_state()
    assert names(tmp_path / "ours" / "checkpoints") == ["checkpoint_0"] and accelerator.save_iteration == 0


def test_without_automatic_naming_a_directory_is_needed(make):
    accelerator, *_ = make(fix=True)
    with pytest.raises(CkptDoctorError, match="needs an output_dir"):
        accelerator.save_state()
    with pytest.raises(CkptDoctorError, match="needs an input_dir"):
        accelerator.load_state()



"""patches/mova-feat-npu.patch against MOVA's extract, and the harness's bad-input lines (fast)."""

import hashlib
import shutil
import subprocess
import sys

import pytest

from ckptdoctor.repro.mova.job import COMMIT, PATCH, PATCHED_FILES, TRAINER, Extract, ExtractProblem, apply_patch


def test_the_patch_applies_to_movas_extract_and_stays_small(extract, tmp_path):
    copy = extract.copy_to(tmp_path / "mova", integration=None)
    apply_patch(copy, check_only=True)  # git apply --check
    changed = [line for line in PATCH.read_text().splitlines()
               if line[:1] in "+-" and not line.startswith(("+++", "---"))]
    assert len(changed) <= 40, f"the patch changes {len(changed)} lines"
    apply_patch(copy)
    patched = (copy / TRAINER).read_text()
    assert "self.ckpt.save_state(" in patched and "self.accelerator.save_state(" not in patched
    assert "self.ckpt.load_state(" in patched and "self.ckpt.latest(" in patched
    assert "self.accelerator.get_state_dict(self.model)" not in patched  # no full-model gather for LoRA


def test_a_copy_inside_a_git_work_tree_is_patched_and_checked_by_its_content(extract, tmp_path):
    """`ckptdoctor repro --fix` copies MOVA under the checkout's runs/, where a plain `git apply`
    skipped every file and exited 0: the copy must hold the patched trainer, by its sha256."""
    subprocess.run(["git", "init", "--quiet", str(tmp_path)], check=True)
    copy = extract.copy_to(tmp_path / "runs" / "repro" / "mova-patched", integration="full")
    assert hashlib.sha256((copy / TRAINER).read_bytes()).hexdigest() == PATCHED_FILES[str(TRAINER)]
    assert "self.ckpt.save_state(" in (copy / TRAINER).read_text()


def test_a_missing_extract_is_one_clear_line(tmp_path):
    with pytest.raises(ExtractProblem, match="no MOVA extract at .*CKPTDOCTOR_MOVA_EXTRACT"):
        Extract.find(tmp_path / "nowhere")


def test_an_extract_at_another_commit_or_edited_is_refused(extract, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(extract.path, other)
    origin = other / "ORIGIN.md"
    origin.chmod(0o644)
    origin.write_text(origin.read_text().replace(COMMIT, "0" * 40))
    with pytest.raises(ExtractProblem, match=f"not at commit {COMMIT[:7]}"):
        Extract.find(other)
    edited = tmp_path / "edited"
    shutil.copytree(extract.path, edited)
    trainer = edited / TRAINER
    trainer.chmod(0o644)
    trainer.write_text(trainer.read_text() + "\n# local change\n")
    with pytest.raises(ExtractProblem, match="differs from MOVA"):
        Extract.find(edited)


def test_a_patch_that_no_longer_applies_is_one_clear_line(extract, tmp_path):
    copy = extract.copy_to(tmp_path / "mova", integration="full")
    with pytest.raises(ExtractProblem, match=f"{PATCH.name} does not apply to .*: error: patch failed"):
        apply_patch(copy)  # already applied: the hunks no longer match


def test_the_cli_says_where_the_extract_is_missing(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "ckptdoctor.cli", "repro", "--trainer", "mova", "--extract",
                           str(tmp_path / "nowhere")], capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "no MOVA extract at" in proc.stderr, proc.stderr


def test_the_harness_wrappers_are_not_reported_as_movas_frames():
    from ckptdoctor.repro.mova import rank

    frames = [{"function": "main", "file": rank.__file__, "line": 1},
              {"function": "main", "file": "/x/scripts/training_scripts/accelerate_train.py", "line": 144},
              {"function": "train", "file": "/x/mova/engine/trainer/accelerate/accelerate_trainer.py", "line": 466},
              {"function": "_save_checkpoint", "file": rank.__file__, "line": 2},
              {"function": "_save_checkpoint", "file": "/x/mova/engine/trainer/accelerate/accelerate_trainer.py",
               "line": 515}]
    assert [(f["function"], f["line"]) for f in rank.without_harness(frames)] == \
        [("main", 144), ("train", 466), ("_save_checkpoint", 515)]

"""apply_diff: a diff counts as applied by what it did to the files, never by git's exit status."""

import hashlib
import subprocess

import pytest

from ckptdoctor.repro.patching import PatchNotApplied, apply_diff, diff_targets

ORIGINAL = "def f():\n    return 1\n"
CHANGED = "def f():\n    return 2\n"
DIFF = """diff --git a/pkg/f.py b/pkg/f.py
--- a/pkg/f.py
+++ b/pkg/f.py
@@ -1,2 +1,2 @@
 def f():
-    return 1
+    return 2
"""


def tree_at(path):
    (path / "pkg").mkdir(parents=True)
    (path / "pkg" / "f.py").write_text(ORIGINAL)
    return path


@pytest.fixture
def diff(tmp_path):
    path = tmp_path / "change.diff"
    path.write_text(DIFF)
    return path


def test_a_copy_inside_another_git_work_tree_is_patched(tmp_path, diff):
    """The defect users met: `git apply` in a directory of the project's own checkout skipped
    every file and exited 0."""
    outer = tmp_path / "checkout"
    outer.mkdir()
    subprocess.run(["git", "init", "--quiet", str(outer)], check=True)
    tree = tree_at(outer / "runs" / "copy")
    plain = subprocess.run(["git", "apply", str(diff)], cwd=tree, capture_output=True, text=True)
    assert plain.returncode == 0 and (tree / "pkg" / "f.py").read_text() == ORIGINAL  # git's silent skip, shown
    apply_diff(tree, diff, expected={"pkg/f.py": hashlib.sha256(CHANGED.encode()).hexdigest()})
    assert (tree / "pkg" / "f.py").read_text() == CHANGED


def test_check_only_leaves_the_files_alone(tmp_path, diff):
    tree = tree_at(tmp_path / "copy")
    apply_diff(tree, diff, check_only=True)
    assert (tree / "pkg" / "f.py").read_text() == ORIGINAL


def test_a_result_other_than_the_expected_one_is_refused(tmp_path, diff):
    tree = tree_at(tmp_path / "copy")
    with pytest.raises(PatchNotApplied, match="pkg/f.py is not the expected result"):
        apply_diff(tree, diff, expected={"pkg/f.py": "0" * 64})


def test_a_diff_that_does_not_apply_is_one_line(tmp_path, diff):
    tree = tree_at(tmp_path / "copy")
    (tree / "pkg" / "f.py").write_text("something else\n")
    with pytest.raises(PatchNotApplied, match=r"change.diff does not apply to .*: error") as raised:
        apply_diff(tree, diff)
    assert "\n" not in str(raised.value)


def test_a_diff_that_names_no_file_is_refused(tmp_path):
    empty = tmp_path / "empty.diff"
    empty.write_text("not a diff\n")
    with pytest.raises(PatchNotApplied, match="names no file"):
        apply_diff(tree_at(tmp_path / "copy"), empty)


def test_the_targets_are_read_from_the_diff_headers():
    assert diff_targets(DIFF + DIFF.replace("pkg/f.py", "pkg/g.py")) == ["pkg/f.py", "pkg/g.py"]

"""Apply a diff to a scratch copy of a tree, and prove by its effect that it applied.

`git apply` run in a directory inside another git work tree (a scratch copy under the
project's own checkout, say) resolves the diff's paths against that work tree, skips every
file and still exits 0. So an exit status proves nothing here. `apply_diff` keeps git from
looking above the tree (GIT_CEILING_DIRECTORIES) and then checks the files themselves: every
file the diff names must have changed, and where the caller knows the expected result, each
must hash to it.
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
from pathlib import Path

from ..errors import CkptDoctorError

DIFF_TARGET = re.compile(r"^diff --git a/(\S+) b/(\S+)$", re.MULTILINE)


class PatchNotApplied(CkptDoctorError):
    """The diff does not apply, or applying it did not change the files it names."""


def sha256_of(path: Path) -> str | None:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None


def diff_targets(diff_text: str) -> list[str]:
    """The paths a git diff changes (its `b/` side; a deletion names the same path)."""
    return sorted({b for _, b in DIFF_TARGET.findall(diff_text)})


def apply_diff(tree: Path, diff: Path, expected: dict[str, str] | None = None, check_only: bool = False) -> None:
    """`git apply` `diff` inside `tree`; raise PatchNotApplied (one line) unless every file it
    names changed, and, for the paths in `expected`, now has that sha256."""
    tree, diff = Path(tree).absolute(), Path(diff).absolute()
    targets = diff_targets(diff.read_text())
    if not targets:
        raise PatchNotApplied(f"{diff.name} names no file to change")
    before = {name: sha256_of(tree / name) for name in targets}
    env = {**os.environ, "GIT_CEILING_DIRECTORIES": str(tree.parent)}
    command = ["git", "apply", "--verbose", *(["--check"] if check_only else []), str(diff)]
    proc = subprocess.run(command, cwd=tree, capture_output=True, text=True, env=env)
    lines = proc.stderr.strip().splitlines()
    if proc.returncode != 0:
        errors = [line for line in lines if line.startswith("error")] or lines or ["(no message)"]
        first = next((line for line in errors if line.startswith("error: patch failed")), errors[0])
        raise PatchNotApplied(f"{diff.name} does not apply to {tree}: {first}")
    skipped = [line for line in lines if line.startswith("Skipped patch")]
    if skipped:  # git's own word (with --verbose) that it left a file alone, exit 0 regardless
        raise PatchNotApplied(f"git apply skipped files of {diff.name} in {tree}: {skipped[0]}")
    if check_only:
        return
    unchanged = [name for name in targets if sha256_of(tree / name) == before[name]]
    if unchanged:
        raise PatchNotApplied(f"git apply exited 0 but left {', '.join(unchanged)} unchanged in {tree}")
    wrong = [name for name, digest in (expected or {}).items() if sha256_of(tree / name) != digest]
    if wrong:
        raise PatchNotApplied(f"{diff.name} applied to {tree}, but {', '.join(wrong)} is not the expected result")

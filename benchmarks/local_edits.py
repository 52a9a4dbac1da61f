"""Both integration levels, and GNU patch for contrast, against MOVA's trainer with local lines.

    .venv/user/bin/python benchmarks/local_edits.py [--out docs/evidence/local_edits.txt]

For each placement of repro/mova/local_edits.py: whether `git apply --check` accepts the full
patch, where `ckptdoctor integrate` puts the minimal integration, and what `patch -p1` (fuzz 2,
its default) would do, hunk by hunk: the way the guide forbids, shown here. Writes a table.
"""

import argparse
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from ckptdoctor.integrate import CannotIntegrate, integrate
from ckptdoctor.repro.mova.job import PATCH, TRAINER, Extract
from ckptdoctor.repro.mova.local_edits import PLACEMENTS, with_local_lines


def one(extract: Extract, work: Path, blocks) -> dict:
    copy = extract.copy_to(work / "mova", integration=None)
    trainer = copy / TRAINER
    trainer.write_text(with_local_lines(trainer.read_text(), blocks))
    env = {**os.environ, "GIT_CEILING_DIRECTORIES": str(work)}
    git = subprocess.run(["git", "apply", "--check", str(PATCH)], cwd=copy, env=env, capture_output=True, text=True)
    try:
        minimal = integrate(trainer, check_only=True).describe().split(" ", 1)[1]
    except CannotIntegrate as stopped:
        minimal = f"stops: {stopped}"
    fuzz = None
    if shutil.which("patch"):
        dry = subprocess.run(["patch", "-p1", "--dry-run", "-i", str(PATCH)], cwd=copy, capture_output=True, text=True)
        fuzz = [line for line in dry.stdout.splitlines() if line.startswith("Hunk")]
    return {"git_apply": "applies" if git.returncode == 0 else "refused (" + git.stderr.strip().splitlines()[-1] + ")",
            "integrate": minimal, "gnu_patch": fuzz}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the table here")
    args = parser.parse_args()
    extract, lines = Extract.find(), []
    for name, blocks in PLACEMENTS.items():
        work = Path(tempfile.mkdtemp(prefix="ckptdoctor-edits-"))
        try:
            row = one(extract, work, blocks)
        finally:
            shutil.rmtree(work)
        lines += [f"{name}:", f"  full patch, git apply --check: {row['git_apply']}",
                  f"  minimal, ckptdoctor integrate: {row['integrate']}"]
        if row["gnu_patch"] is not None:
            lines.append(f"  GNU patch -p1 (fuzz 2, not to be used): {'; '.join(row['gnu_patch']) or 'every hunk exact'}")
    text = "\n".join(lines) + "\n"
    print(text, end="")
    if args.out:
        Path(args.out).write_text("# benchmarks/local_edits.py: both integration levels on MOVA's trainer with the "
                                  "reporter's local lines\n" + text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

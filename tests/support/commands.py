"""Run the README's commands the way a user does: the installed `ckptdoctor` script or
`scripts/...`, in a working directory, with default (relative) paths."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from .paths import REPO

CKPTDOCTOR = str(Path(sys.executable).parent / "ckptdoctor")  # the console script pip installed


def run(argv: list[str], cwd: Path, env: dict | None = None, timeout_s: float = 3600) -> subprocess.CompletedProcess:
    return subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=timeout_s,
                          env={**os.environ, **(env or {})})


def first_run(argv: list[str], cwd: Path, out: str = "runs/repro", env: dict | None = None,
              report: str = "report.json") -> tuple[subprocess.CompletedProcess, dict]:
    """A `repro` command as on a first run (its default output directory, relative to `cwd`,
    removed first), and the report it wrote there."""
    shutil.rmtree(cwd / out, ignore_errors=True)
    return rerun(argv, cwd, out, env, report)


def rerun(argv, cwd: Path, out: str = "runs/repro", env: dict | None = None, report: str = "report.json"):
    proc = run(argv, cwd, env)
    path = cwd / out / report
    assert path.is_file(), f"{' '.join(argv)} wrote no {out}/{report} (exit {proc.returncode}): {proc.stderr[-2000:]}"
    return proc, json.loads(path.read_text())


def verdict_line(proc: subprocess.CompletedProcess) -> str:
    """The line the report starts with (REPRODUCED, FIXED, ...), after the progress lines."""
    return next(line for line in proc.stdout.splitlines() if not line.startswith((" ", "[")))


SCRIPTS_REPRO = [str(REPO / "scripts" / "repro")]

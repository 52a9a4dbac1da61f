"""The code's style, as pyproject.toml's [tool.ruff] states it (lines up to 130 characters,
pyflakes' and pycodestyle's errors and warnings), checked on every Python file of the checkout.
ruff is pinned in both stacks' lock files, so CI runs it on each."""

import subprocess
import sys

from support.paths import REPO


def test_ruff_finds_nothing_to_report_in_the_checkout():
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise",
                           "src", "tests", "benchmarks"], cwd=REPO, capture_output=True, text=True)
    assert "All checks passed!" in proc.stdout and proc.returncode == 0, proc.stdout + proc.stderr

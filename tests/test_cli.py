"""Bad input gives one clear line on stderr and exit status 2, never a traceback."""

import subprocess
import sys

import pytest

from ckptdoctor.cli import main
from ckptdoctor.repro import stacks

from support.faults import read_only_bind


def _run(*args):
    return subprocess.run([sys.executable, "-m", "ckptdoctor.cli", *args], capture_output=True, text=True, timeout=120)


def _one_clear_line(result, fragment):
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ckptdoctor: error:"), result.stderr
    assert fragment in lines[0]
    assert "Traceback" not in result.stderr + result.stdout


def test_help_lists_the_commands():
    result = _run("--help")
    assert result.returncode == 0 and "repro" in result.stdout
    assert "--ranks" in _run("repro", "--help").stdout


def test_world_size_that_cannot_hold_the_job():
    _one_clear_line(_run("repro", "--ranks", "1"), "at least 2 ranks")


def test_output_directory_that_cannot_be_created(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    _one_clear_line(_run("repro", "--out", str(blocker / "sub")), "cannot create output directory")


def test_unsupported_versions_are_refused(monkeypatch, capsys):
    monkeypatch.setattr(stacks, "installed_versions", lambda: ("2.7.1", "1.12.0"))
    assert main(["repro"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "unsupported versions torch 2.7.1 + accelerate 1.12.0" in err
    assert "torch 2.8.0 + accelerate 1.13.0" in err


def test_unknown_stack_name():
    with pytest.raises(stacks.UnsupportedVersion, match="unknown stack 'nightly'"):
        stacks.stack_by_name("nightly")


@pytest.fixture
def read_only_dir(tmp_path):
    with read_only_bind(tmp_path / "ro") as target:
        yield target


@pytest.mark.parametrize("inside", [False, True])
def test_output_directory_on_a_read_only_filesystem(read_only_dir, inside):
    out = read_only_dir / "runs" if inside else read_only_dir
    result = subprocess.run([sys.executable, "-m", "ckptdoctor.cli", "repro", "--out", "ro/runs" if inside else "ro"],
                            capture_output=True, text=True, timeout=120, cwd=read_only_dir.parent)
    _one_clear_line(result, "Read-only file system" if inside else "is not writable")
    assert not out.exists() or not any(out.iterdir())

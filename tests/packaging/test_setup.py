"""scripts/setup.sh refuses clearly, before pip starts, when it cannot install a stack."""

import os
import shutil
import subprocess

import pytest

from support.paths import REPO as ROOT


@pytest.fixture
def project_copy(tmp_path):
    """Only what setup.sh reads, so a refusal can never touch the real .venv."""
    shutil.copytree(ROOT / "scripts", tmp_path / "scripts")
    shutil.copytree(ROOT / "requirements", tmp_path / "requirements")
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    return tmp_path


def _setup(root, *args, **env):
    return subprocess.run(
        ["bash", str(root / "scripts" / "setup.sh"), *args],
        capture_output=True, text=True, timeout=60, env={**os.environ, **env},
    )


def test_too_little_disk_is_refused_before_anything_is_installed(project_copy):
    result = _setup(project_copy, "user", CKPTDOCTOR_DISK_NEED_MB=str(10**12))
    assert result.returncode == 3, result.stderr
    assert "setup: not enough disk for the 'user' stack" in result.stderr
    assert f"needs about {10**12} MB in {project_copy}" in result.stderr
    assert "MB free; free some space and rerun" in result.stderr
    assert not (project_copy / ".venv").exists()


def test_unknown_stack_is_refused(project_copy):
    result = _setup(project_copy, "nightly")
    assert result.returncode == 2
    assert "setup: unknown stack 'nightly' (expected: user, newest)" in result.stderr
    assert not (project_copy / ".venv").exists()


def test_check_only_prints_what_an_install_needs_and_installs_nothing(project_copy):
    """scripts/test checks every stack this way before it installs them side by side."""
    result = _setup(project_copy, "--check-only", "newest", CKPTDOCTOR_DISK_NEED_MB="5")
    assert result.returncode == 0, result.stderr
    assert result.stdout == "5\n" and result.stderr == ""
    assert not (project_copy / ".venv").exists()


def test_the_installs_beside_it_count_in_the_disk_check(project_copy):
    result = _setup(project_copy, "--check-only", "user", CKPTDOCTOR_DISK_NEED_MB="5",
                    CKPTDOCTOR_DISK_RESERVED_MB=str(10**12))
    assert result.returncode == 3 and result.stdout == ""
    assert f"needs about {10**12 + 5} MB in {project_copy}" in result.stderr
    assert f"(with {10**12} MB for the installs beside it)" in result.stderr
    assert not (project_copy / ".venv").exists()

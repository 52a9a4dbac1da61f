"""Real filesystem faults (root only; a test that cannot make one is skipped, saying why):
a read-only bind mount, a tiny tmpfs that fills up, an ext4 with 1-second timestamps."""

import contextlib
import subprocess
from pathlib import Path

import pytest


def _sh(*args) -> bool:
    return subprocess.run(list(args), capture_output=True).returncode == 0


@contextlib.contextmanager
def _mounted(target: Path, *mount_args: str, then_remount: tuple[str, ...] | None = None):
    target.mkdir(parents=True, exist_ok=True)
    if not _sh("mount", *mount_args, str(target)):
        pytest.skip(f"cannot mount {' '.join(mount_args)} here (needs root and mount(8))")
    try:
        if then_remount and not _sh("mount", *then_remount, str(target)):
            pytest.skip(f"cannot remount {' '.join(then_remount)} here")
        yield target
    finally:
        subprocess.run(["umount", "-l", str(target)], capture_output=True)


def read_only_bind(target: Path):
    """`target` as a read-only bind mount of itself: EROFS for every writer, root included."""
    target.mkdir(parents=True, exist_ok=True)
    return _mounted(target, "--bind", str(target), then_remount=("-o", "remount,bind,ro"))


def small_tmpfs(target: Path, size: str = "1m"):
    """A tmpfs of `size`: writes past it fail with ENOSPC."""
    return _mounted(target, "-t", "tmpfs", "-o", f"size={size}", "tmpfs")


@contextlib.contextmanager
def coarse_timestamps(target: Path, size_mb: int = 32):
    """An ext4 on a loop device with 128-byte inodes: file times have 1-second resolution, as on
    ext3, small-inode ext4 and many NFS servers."""
    image = target.with_name(target.name + ".img")
    with open(image, "wb") as f:
        f.truncate(size_mb << 20)
    if not _sh("mkfs.ext4", "-q", "-F", "-I", "128", str(image)):
        pytest.skip("mkfs.ext4 is not available")
    try:
        with _mounted(target, "-o", "loop", str(image)) as mounted:
            yield mounted
    finally:
        image.unlink(missing_ok=True)

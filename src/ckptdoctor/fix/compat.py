"""Which torch and Accelerate versions the fix is checked against, and the gate that says so.

The fix relies on DCP's planner/storage interfaces and on how Accelerate calls DCP; both are
read from the source of the versions listed here and pinned in tests. Any other version is
refused with one clear line rather than saved through code paths nobody has checked.
"""

from __future__ import annotations

from importlib import metadata

from ..errors import UnsupportedVersion

CHECKED = {"torch": ("2.8.0", "2.14.1"), "accelerate": ("1.13.0", "1.15.0")}


def installed_versions() -> tuple[str, str]:
    """(torch, accelerate) versions of this interpreter, local tags (+cu128) dropped."""
    def version(pkg):
        try:
            return metadata.version(pkg).split("+")[0]
        except metadata.PackageNotFoundError:
            return "not installed"
    return version("torch"), version("accelerate")


def check_torch(what: str) -> None:
    torch_v = installed_versions()[0]
    if torch_v not in CHECKED["torch"]:
        raise UnsupportedVersion(f"{what} is checked on torch {'/'.join(CHECKED['torch'])}, not torch {torch_v}")


def check_versions(what: str = "ScalableCheckpointing") -> None:
    torch_v, accelerate_v = installed_versions()
    if torch_v not in CHECKED["torch"] or accelerate_v not in CHECKED["accelerate"]:
        raise UnsupportedVersion(f"{what} is checked on torch {'/'.join(CHECKED['torch'])} and "
                                 f"accelerate {'/'.join(CHECKED['accelerate'])}, not torch {torch_v} / "
                                 f"accelerate {accelerate_v}")

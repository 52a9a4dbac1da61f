"""Which torch and Accelerate versions the fix is checked against, and the gate that says so.

The fix relies on DCP's planner/storage interfaces and on how Accelerate calls DCP; both are
read from the source of the versions listed here and pinned in tests. Any other version is
refused with one clear line rather than saved through code paths nobody has checked, unless
CKPTDOCTOR_ALLOW_UNCHECKED_VERSIONS=1: then it is logged once, as a warning, and allowed.
torch_npu is named by the torch it is built for (torch_npu 2.8.0.post2 runs on torch 2.8.0):
the gate checks torch.
"""

from __future__ import annotations

import logging
import os
from importlib import metadata

from ..errors import UnsupportedVersion

OVERRIDE = "CKPTDOCTOR_ALLOW_UNCHECKED_VERSIONS"
log = logging.getLogger("ckptdoctor.compat")
_warned: set[str] = set()

CHECKED = {"torch": ("2.8.0", "2.14.1"), "accelerate": ("1.13.0", "1.15.0")}


def installed_versions() -> tuple[str, str]:
    """(torch, accelerate) versions of this interpreter, local tags (+cu128) dropped."""
    def version(pkg):
        try:
            return metadata.version(pkg).split("+")[0]
        except metadata.PackageNotFoundError:
            return "not installed"
    return version("torch"), version("accelerate")


def torch_npu_note() -> str:
    """", torch_npu X" when torch_npu is installed (it names the torch it is built for)."""
    try:
        return f", torch_npu {metadata.version('torch_npu')}"
    except metadata.PackageNotFoundError:
        return ""


def check_torch(what: str) -> None:
    torch_v = installed_versions()[0]
    if torch_v not in CHECKED["torch"]:
        _refuse(f"{what} is checked on torch {'/'.join(CHECKED['torch'])}, not torch {torch_v}{torch_npu_note()}")


def check_versions(what: str = "ScalableCheckpointing") -> None:
    torch_v, accelerate_v = installed_versions()
    if torch_v not in CHECKED["torch"] or accelerate_v not in CHECKED["accelerate"]:
        _refuse(f"{what} is checked on torch {'/'.join(CHECKED['torch'])} and accelerate "
                f"{'/'.join(CHECKED['accelerate'])}, not torch {torch_v}{torch_npu_note()} / accelerate {accelerate_v}")


def _refuse(message: str) -> None:
    """Raise, or with the override, warn once per message and go on."""
    if os.environ.get(OVERRIDE, "").strip() != "1":
        raise UnsupportedVersion(f"{message}; to run it anyway, unchecked, set {OVERRIDE}=1")
    if message not in _warned:
        _warned.add(message)
        log.warning("ckptdoctor: %s; running anyway because %s=1 (unchecked)", message, OVERRIDE)

"""Which torch and Accelerate versions the fix is checked against, and the gate that says so.

The fix relies on DCP's planner/storage interfaces and on how Accelerate calls DCP. The gate
accepts the ranges a compatibility run passed (`benchmarks/compat_matrix.py`, raw outcomes in
`docs/evidence/compat_matrix.jsonl`: the fix's core tests on a release of every torch minor from
2.8 to 2.15 with Accelerate 1.15.0 or 1.16.0, and Accelerate 1.13.0, 1.14.0 and 1.16.0 with torch
2.8.0; CI runs the whole suite on torch 2.8.0 + Accelerate 1.13.0 and on 2.15.0 + 1.16.0). Anything
outside, a
pre-release included, is refused with one clear line rather than saved through code paths nobody
has checked, unless CKPTDOCTOR_ALLOW_UNCHECKED_VERSIONS=1: then it is logged once, as a warning,
and allowed. torch_npu is named by the torch it is built for (torch_npu 2.8.0.post2 runs on torch
2.8.0, torch_npu 2.14.0 on torch 2.14.0): the gate checks torch.
"""

from __future__ import annotations

import logging
import os
import re
from importlib import metadata

from ..errors import UnsupportedVersion

OVERRIDE = "CKPTDOCTOR_ALLOW_UNCHECKED_VERSIONS"
log = logging.getLogger(__name__)
_warned: set[str] = set()

CHECKED = {"torch": ("2.8.0", "2.15.0"), "accelerate": ("1.13.0", "1.16.0")}  # (lowest, highest), inclusive
RELEASE = re.compile(r"^(\d+)\.(\d+)\.(\d+)$")


def within(version: str, package: str) -> bool:
    """Whether `version` (a final release, local tag dropped) lies in the checked range of `package`."""
    match = RELEASE.match(version)
    if not match:
        return False
    low, high = (tuple(map(int, v.split("."))) for v in CHECKED[package])
    return low <= tuple(map(int, match.groups())) <= high


def describe_checked(package: str) -> str:
    return f"{package} {CHECKED[package][0]} to {CHECKED[package][1]}"


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
    if not within(torch_v, "torch"):
        _refuse(f"{what} is checked on {describe_checked('torch')}, not torch {torch_v}{torch_npu_note()}")


def check_versions(what: str = "ScalableCheckpointing") -> None:
    torch_v, accelerate_v = installed_versions()
    if not (within(torch_v, "torch") and within(accelerate_v, "accelerate")):
        _refuse(f"{what} is checked on {describe_checked('torch')} and {describe_checked('accelerate')}, not torch "
                f"{torch_v}{torch_npu_note()} / accelerate {accelerate_v}")


def _refuse(message: str) -> None:
    """Raise, or with the override, warn once per message and go on."""
    if os.environ.get(OVERRIDE, "").strip() != "1":
        raise UnsupportedVersion(f"{message}; to run it anyway, unchecked, set {OVERRIDE}=1")
    if message not in _warned:
        _warned.add(message)
        log.warning("ckptdoctor: %s; running anyway because %s=1 (unchecked)", message, OVERRIDE)

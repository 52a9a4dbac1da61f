"""Accelerate's own tests, fetched from its source distribution at run time and run stock or with
the fix (`import ckptdoctor.auto`), with or without a one-rank gloo process group.

Used by tests/acceptance/test_accelerate_own_tests.py (CI) and benchmarks/accelerate_tests.py
(the larger selection, a report in docs/evidence/). Nothing of Accelerate's code is committed:
the sdist is downloaded from the package registry and checked against the sha256 below.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import tarfile
import xml.etree.ElementTree as ET
from pathlib import Path

SDIST_SHA256 = {  # the registry's accelerate-<v>.tar.gz, as downloaded 2026-12-06
    "1.13.0": "d631b4e0f5b3de4aff2d7e9e6857d164810dfc3237d54d017f075122d057b236",
    "1.14.0": "41b9c4377a54e0b460a959b0defa1b736e4ca0a2373252d9a539964c2afe3c8d",
    "1.15.0": "5654f8c5eaa0d4fa68b33e287a97765da6849bf6d51dcac874e73fbbddfb6134",
    "1.16.0": "43c446b9affb145220946a63fe32e14e968fcfca645d25b5f1f3fdbc375657ae",
}
TEST_ONLY_PACKAGES = ["parameterized==0.9.0"]
FIX_PLUGIN = "import ckptdoctor.auto  # ckptdoctor.install(accelerator) after every Accelerator.prepare\n"
GROUP_PLUGIN = """\
import os
import torch.distributed as dist
from ckptdoctor.ports import free_port

os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1")
dist.init_process_group("gloo")  # one rank: how a job of one process inside a launcher runs
"""
VERSION_PLUGIN = """\
import json, os
import accelerate, torch

with open(os.environ["CKPTDOCTOR_VERSIONS_JSON"], "w") as f:  # what the run imported, from the run itself
    json.dump({"accelerate": accelerate.__version__, "accelerate_file": accelerate.__file__,
               "torch": torch.__version__.split("+")[0]}, f)
"""
PIP_ENV = {"PIP_CONSTRAINT": "/dev/null", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}


class Unavailable(Exception):
    """The sdist or a test-only package could not be fetched (no registry, unknown version)."""


def fetch(python: str, version: str, scratch: Path) -> Path:
    """Accelerate `version`'s sdist from the registry, its sha256 checked, extracted under
    `scratch`, with the test-only packages in `scratch/site`. Returns the source root."""
    if version not in SDIST_SHA256:
        raise Unavailable(f"no pinned sha256 for accelerate {version}'s sdist (known: {', '.join(SDIST_SHA256)})")
    env = {**os.environ, **PIP_ENV}
    got = subprocess.run([python, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:", "-d",
                          str(scratch), f"accelerate=={version}"], capture_output=True, text=True, env=env)
    sdist = scratch / f"accelerate-{version}.tar.gz"
    if not sdist.is_file():
        raise Unavailable(f"could not download accelerate {version}'s sdist: {got.stderr.strip()[-300:]}")
    digest = hashlib.sha256(sdist.read_bytes()).hexdigest()
    if digest != SDIST_SHA256[version]:
        raise AssertionError(f"{sdist.name} has sha256 {digest}, pinned {SDIST_SHA256[version]}")
    with tarfile.open(sdist) as tar:
        tar.extractall(scratch, filter="data")
    got = subprocess.run([python, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(scratch / "site"),
                          *TEST_ONLY_PACKAGES], capture_output=True, text=True, env=env)
    if got.returncode:
        raise Unavailable(f"could not install {TEST_ONLY_PACKAGES}: {got.stderr.strip()[-300:]}")
    return scratch / f"accelerate-{version}"


def overlay(python: str, version: str, scratch: Path) -> Path:
    """Accelerate `version` from the registry, without its dependencies (the stack's own serve),
    in a directory of its own: `run(..., overlay=...)` puts it ahead of the stack's Accelerate, so
    that one stack's interpreter runs another Accelerate release's tests against that release."""
    target = scratch / f"accelerate-{version}-site"
    got = subprocess.run([python, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(target),
                          f"accelerate=={version}"], capture_output=True, text=True, env={**os.environ, **PIP_ENV})
    if got.returncode:
        raise Unavailable(f"could not install accelerate {version}: {got.stderr.strip()[-300:]}")
    return target


def run(python: str, source: Path, files: list[str], scratch: Path, fix: bool, group: bool,
        src: Path | None = None, overlay: Path | None = None) -> Outcomes:
    """Run Accelerate's test `files` in `source` with pytest; test id -> (passed | failed |
    skipped, the failure's first line). `overlay`: an Accelerate release to run instead of the
    stack's (see `overlay()`)."""
    name = f"{'ours' if fix else 'stock'}-{'group' if group else 'alone'}"
    plugins = scratch / "plugins"
    plugins.mkdir(exist_ok=True)
    (plugins / "ckptdoctor_fix.py").write_text(FIX_PLUGIN)
    (plugins / "one_rank_group.py").write_text(GROUP_PLUGIN)
    (plugins / "imported_versions.py").write_text(VERSION_PLUGIN)
    junit = scratch / f"junit-{name}{'-' + overlay.name if overlay else ''}.xml"
    args = [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}", "-p", "imported_versions"]
    args += ["-p", "one_rank_group"] * group + ["-p", "ckptdoctor_fix"] * fix
    paths = [str(plugins), str(scratch / "site")] + ([str(overlay)] if overlay else []) + ([str(src)] if src else [])
    env = {"PYTHONPATH": os.pathsep.join(paths), "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
           "HOME": str(scratch), "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "",
           "CKPTDOCTOR_VERSIONS_JSON": str(junit.with_suffix(".versions.json"))}
    proc = subprocess.run(args + files, cwd=source, env=env, capture_output=True, text=True, timeout=1800)
    if not junit.exists():
        raise AssertionError(f"pytest wrote no report for the {name} run: {proc.stdout[-1500:]}{proc.stderr[-1500:]}")
    found = outcomes(junit)
    found.imported = json.loads(junit.with_suffix(".versions.json").read_text())
    return found


class Outcomes(dict):
    """test id -> (outcome, first line of the failure); `imported`: the versions the run imported
    (read inside the run: {"accelerate", "accelerate_file", "torch"})."""
    imported: dict = {}


def outcomes(junit: Path) -> Outcomes:
    found = Outcomes()
    for case in ET.parse(junit).iter("testcase"):
        failure = case.find("failure")
        failure = case.find("error") if failure is None else failure
        if failure is not None:
            message = (failure.get("message") or "").strip()
            found[f"{case.get('classname')}::{case.get('name')}"] = ("failed", message.splitlines()[0][:200]
                                                                     if message else "")
        elif case.find("skipped") is not None:
            found[f"{case.get('classname')}::{case.get('name')}"] = ("skipped", "")
        else:
            found[f"{case.get('classname')}::{case.get('name')}"] = ("passed", "")
    return found


def passed(found: dict) -> set[str]:
    return {name for name, (outcome, _) in found.items() if outcome == "passed"}


def regressions(stock: dict, ours: dict) -> dict[str, str]:
    """Tests stock passed and the fix did not -> what the fix's run said."""
    return {name: ours.get(name, ("missing", ""))[1] or ours.get(name, ("missing",))[0]
            for name in sorted(passed(stock) - passed(ours))}

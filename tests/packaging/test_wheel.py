"""`python -m build` makes a wheel; installed beside a training image's torch it saves with the planner."""

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest

from ckptdoctor.repro.launcher import launch

from support.paths import JOBS, REPO

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    """The wheel, built from a copy of the sources (the checkout stays clean)."""
    src = tmp_path_factory.mktemp("src")
    shutil.copytree(REPO / "src", src / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    shutil.copy(REPO / "pyproject.toml", src)
    shutil.copy(REPO / "README.md", src)
    shutil.copytree(REPO / "docs", src / "docs", ignore=shutil.ignore_patterns("evidence", "figures"))
    out = tmp_path_factory.mktemp("dist")
    subprocess.run([sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(out), str(src)],
                   check=True, capture_output=True, text=True)
    (path,) = out.glob("ckptdoctor-*.whl")
    return path


def test_the_wheel_holds_the_package_and_declares_no_dependency(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    assert "ckptdoctor/fix/planner.py" in names and "ckptdoctor/repro/reproduce.py" in names
    metadata = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("METADATA"))).decode()
    required = [line for line in metadata.splitlines() if line.startswith("Requires-Dist:")]
    assert required and all("extra ==" in line for line in required), required  # only extras pull anything in


@pytest.fixture(scope="module")
def image(wheel, tmp_path_factory):
    """A scratch venv standing for a training image: the stack's torch, and the wheel installed
    with pip (no index, no dependencies fetched)."""
    root = tmp_path_factory.mktemp("image")
    venv.create(root, with_pip=True)
    python = root / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    # The image's torch: this stack's site-packages on the path (its .pth files, such as the
    # editable ckptdoctor, are not processed from a path added this way).
    with open(f"{site}/stack-torch.pth", "w") as f:
        f.write(sysconfig.get_paths()["purelib"] + "\n")
    proc = subprocess.run([str(python), "-m", "pip", "install", "--no-index", "--no-deps", "--quiet", str(wheel)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return python, site


def test_a_2_rank_save_with_the_installed_wheel_loads_bit_exactly_and_check_predicts_it(image, tmp_path):
    python, site = image
    ckpt = tmp_path / "ckpt"
    # PYTHONPATH emptied: the image sees only its own site-packages and the stack's torch
    result = launch([str(JOBS / "wheel_job.py"), str(ckpt)], 2, tmp_path / "job.log", timeout_s=300, python=str(python),
                    env={"PYTHONPATH": ""})
    assert result.returncodes == [0, 0], (tmp_path / "job.log").read_text()[-3000:]
    reports = [json.loads((tmp_path / f"ckpt.rank{r}.json").read_text()) for r in range(2)]
    for report in reports:
        assert report["ckptdoctor"].startswith(site), report  # the wheel's copy, not this checkout's
        assert report["mode"] == "derived" and report["mismatches"] == []


    # check, from the installed wheel, predicts that checkpoint's save at 32 ranks (a relative path)
    proc = subprocess.run([str(python), "-m", "ckptdoctor", "check", "--ranks", "32", "--from-checkpoint", "ckpt",
                           "--json", "check.json"], cwd=tmp_path, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "PYTHONPATH": ""})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "check.json").read_text())
    assert {(r["save"], r["planner"]) for r in result["records"]} == {("ckpt", "stock"), ("ckpt", "ours")}
    assert "OK: every save plans in under 50% of the 1800 s deadline" in proc.stdout
    assert "note: stock figures past N = 16 are extrapolated" in proc.stdout  # measured up to 16, 32 is a fit
    assert [r["measured"] for r in result["records"] if r["planner"] == "stock"] == [False]


def test_selftest_at_8_ranks_runs_from_the_installed_wheel_with_no_checkout(image, tmp_path):
    """The cluster's case: a wheel in an image that has torch and Accelerate, run under torchrun
    from the user's own directory; nothing of this checkout on the path."""
    python, site = image
    proc = subprocess.run([str(python), "-m", "torch.distributed.run", "--nproc-per-node", "8", "-m", "ckptdoctor",
                           "selftest", "--dir", "ckpt", "--stock", "--json", "r.json"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=900,
                          env={**os.environ, "PYTHONPATH": "", "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["ckptdoctor"].startswith(site) and report["world_size"] == 8, report["ckptdoctor"]
    verdicts = {c["name"]: c["verdict"] for c in report["checks"]}
    assert set(verdicts.values()) == {"PASS"} and "stock plan exchange" in verdicts and len(verdicts) == 13, verdicts


def test_the_installed_wheel_shows_every_document_from_any_directory(image, tmp_path):
    """Messages in a training image say `ckptdoctor docs fix-for-mova`: the wheel carries the documents."""
    from ckptdoctor.documents import DOCUMENTS

    python, site = image
    for name, path in DOCUMENTS.items():
        proc = subprocess.run([str(python), "-m", "ckptdoctor", "docs", name], cwd=tmp_path, capture_output=True,
                              text=True, env={**os.environ, "PYTHONPATH": ""})
        assert proc.returncode == 0 and proc.stdout == (REPO / path).read_text(), (name, proc.stderr)
        where = subprocess.run([str(python), "-m", "ckptdoctor", "docs", name, "--path"], cwd=tmp_path,
                               capture_output=True, text=True, env={**os.environ, "PYTHONPATH": ""}).stdout.strip()
        assert where.endswith(f"share/ckptdoctor/{Path(path).name}") and not where.startswith(str(REPO)), where

"""Tests on MOVA's own trainer code: the extract in ../shared/mova-feat-npu (or
$CKPTDOCTOR_MOVA_EXTRACT), copied to a scratch directory, patched or not, run by
ckptdoctor's harness (src/ckptdoctor/repro/mova). Skipped with the reason when the extract
is absent; the look-alike trainer's tests (tests/repro) cover the mechanism then."""

import pytest

from ckptdoctor.repro.mova.job import Extract, ExtractProblem


@pytest.fixture(scope="session")
def extract() -> Extract:
    try:
        return Extract.find()
    except ExtractProblem as problem:
        pytest.skip(f"MOVA's trainer is not here: {problem}")


@pytest.fixture(scope="session")
def mova_copies(extract, tmp_path_factory):
    """Scratch copies of MOVA's code: {"stock": unpatched, "patched": with patches/mova-feat-npu.patch,
    "minimal": with `ckptdoctor integrate` (level 1)}."""
    root = tmp_path_factory.mktemp("mova-code")
    return {"stock": extract.copy_to(root / "stock", integration=None),
            "patched": extract.copy_to(root / "patched", integration="full"),
            "minimal": extract.copy_to(root / "minimal", integration="minimal")}

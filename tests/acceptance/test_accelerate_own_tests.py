"""Accelerate's own checkpointing tests pass with the fix exactly where they pass stock.

`tests/test_state_checkpointing.py` from the sdist of an Accelerate release (fetched from the
registry at run time, its sha256 pinned in support/accelerate_suite.py), run in one process as
Accelerate runs it, stock and with `import ckptdoctor.auto` (so `install` follows every
`prepare`): without a process group, and inside a one-rank gloo group. Each stack runs its own
Accelerate both ways, and one more release the gate accepts inside the group, installed over it
for the run (the user stack's torch 2.8.0 with Accelerate 1.14.0, the newest stack's torch 2.15.0
with 1.15.0), so that every release from 1.13.0 to 1.16.0 is run by CI. The larger selection (`tests/test_accelerator.py`
too) is `benchmarks/accelerate_tests.py`."""

import sys

import pytest

from ckptdoctor.fix.compat import installed_versions, within
from ckptdoctor.repro.stacks import NEWEST, USER
from support import accelerate_suite as suite

FILES = ["tests/test_state_checkpointing.py"]
OTHER_RELEASE = {USER.torch: "1.14.0", NEWEST.torch: "1.15.0"}  # torch -> the extra Accelerate it runs
TORCH, INSTALLED = installed_versions()
# (release, inside a one-rank gloo group): the stack's own release both ways; the other release in
# the group, the mode where the fix's machinery (checkpoint group, agreement) runs. Both modes of
# every release: benchmarks/accelerate_tests.py
CASES = [(INSTALLED, False), (INSTALLED, True)] + [(OTHER_RELEASE[TORCH], True)] * (TORCH in OTHER_RELEASE)
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """Accelerate release -> (its source tree, scratch directory, the overlay or None), fetched once."""
    fetched = {}

    def source(version):
        if version not in fetched:
            scratch = tmp_path_factory.mktemp(f"accelerate-{version}")
            try:
                tree = suite.fetch(sys.executable, version, scratch)
                over = None if version == INSTALLED else suite.overlay(sys.executable, version, scratch)
            except suite.Unavailable as error:
                pytest.skip(str(error))
            fetched[version] = tree, scratch, over
        return fetched[version]
    return source


@pytest.mark.parametrize(("version", "group"), CASES,
                         ids=[f"{v}-{'one-rank-gloo-group' if g else 'no-process-group'}" for v, g in CASES])
def test_accelerates_checkpointing_tests_pass_with_the_fix_wherever_they_pass_stock(sources, version, group):
    assert within(version, "accelerate")  # a release the gate accepts: the fix runs, it is not refused
    root, scratch, over = sources(version)
    stock = suite.run(sys.executable, root, FILES, scratch, fix=False, group=group, overlay=over)
    ours = suite.run(sys.executable, root, FILES, scratch, fix=True, group=group, overlay=over)
    for run in (stock, ours):  # the release under test is the one both runs imported
        assert (run.imported["accelerate"], run.imported["torch"]) == (version, TORCH), run.imported
    assert len(suite.passed(stock)) >= 10, stock  # the file's own tests ran (16 pass stock on 1.13.0 here)
    assert suite.regressions(stock, ours) == {}
    assert suite.passed(ours) == suite.passed(stock)

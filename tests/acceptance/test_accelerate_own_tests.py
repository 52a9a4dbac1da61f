"""Accelerate's own checkpointing tests pass with the fix exactly where they pass stock.

`tests/test_state_checkpointing.py` from the sdist of the Accelerate installed here (fetched from
the registry at run time, its sha256 pinned in support/accelerate_suite.py), run in one process
as Accelerate runs it, stock and with `import ckptdoctor.auto` (so `install` follows every
`prepare`): without a process group, and inside a one-rank gloo group. The larger selection
(`tests/test_accelerator.py` too) is `benchmarks/accelerate_tests.py`."""

import sys

import pytest

from ckptdoctor.fix.compat import installed_versions
from support import accelerate_suite as suite

FILES = ["tests/test_state_checkpointing.py"]
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    scratch = tmp_path_factory.mktemp("accelerate-sdist")
    try:
        return suite.fetch(sys.executable, installed_versions()[1], scratch), scratch
    except suite.Unavailable as error:
        pytest.skip(str(error))


@pytest.mark.parametrize("group", [False, True], ids=["no-process-group", "one-rank-gloo-group"])
def test_accelerates_checkpointing_tests_pass_with_the_fix_wherever_they_pass_stock(source, group):
    root, scratch = source
    stock = suite.run(sys.executable, root, FILES, scratch, fix=False, group=group)
    ours = suite.run(sys.executable, root, FILES, scratch, fix=True, group=group)
    assert len(suite.passed(stock)) >= 10, stock  # the file's own tests ran (16 pass stock on 1.13.0 here)
    assert suite.regressions(stock, ours) == {}
    assert suite.passed(ours) == suite.passed(stock)

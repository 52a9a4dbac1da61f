"""Reading DCP's per-rank failure report (fix/dcp_failures.py) on torch's own CheckpointException."""

from torch.distributed.checkpoint.api import CheckpointException

from ckptdoctor.fix import dcp_failures
from ckptdoctor.fix.agreement import describe
from ckptdoctor.fix.planner import NotDerivable


def report():
    disk = OSError(28, "No space left on device")
    return CheckpointException("save failed", {3: (NotDerivable("ranks differ"), None), 1: disk})


def test_each_failed_rank_maps_to_its_exception_whether_or_not_a_traceback_rides_along():
    failed = dcp_failures.per_rank(report())
    assert sorted(failed) == [1, 3] and isinstance(failed[3], NotDerivable) and failed[1].errno == 28


def test_the_first_failure_is_the_lowest_ranks_and_a_plain_error_is_its_own():
    assert dcp_failures.first(report()).errno == 28
    plain = ValueError("x")
    assert dcp_failures.first(plain) is plain and dcp_failures.per_rank(plain) == {}


def test_the_one_line_names_every_failed_rank_and_the_lowest_ones_reason():
    assert describe(report()) == "in DCP on rank(s) 1,3: OSError: [Errno 28] No space left on device"

"""`install` on a real Accelerate job of several processes: MULTI_CPU (DDP over gloo), two ranks,
Accelerate's automatic checkpoint naming with total_limit (tests/jobs/accelerate_ddp_job.py)."""

import json

import pytest

from support.paths import JOBS

pytestmark = pytest.mark.slow


def ddp_job(tmp_path, mode):
    from ckptdoctor.repro.launcher import launch

    out = tmp_path / mode
    out.mkdir()
    result = launch([str(JOBS / "accelerate_ddp_job.py"), str(out), mode], 2, out / "job.log", timeout_s=300,
                    env={"ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1", "CKPTDOCTOR_GROUP_TIMEOUT_S": "120"})
    return result, [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)], out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ddp")
    return {mode: ddp_job(tmp, mode) for mode in ("stock", "fix")}


def test_two_ddp_ranks_save_and_resume_the_newest_as_stock_does(runs):
    for mode in ("stock", "fix"):
        result, reports, out = runs[mode]
        assert result.returncodes == [0, 0], (out / "job.log").read_text()[-3000:]
        for r in reports:
            assert r["distributed_type"] == "DistributedType.MULTI_CPU"
            assert r["loaded"] == r["saved"] != r["moved"]  # the newest checkpoint, bit for bit
    assert [r["iteration"] for r in runs["fix"][1]] == [r["iteration"] for r in runs["stock"][1]] == [3, 3]
    assert runs["stock"][1][0]["checkpoints"] == ["checkpoint_1", "checkpoint_2"]


def test_a_save_failing_on_one_ddp_rank_is_one_error_on_both_and_keeps_k_complete_checkpoints(runs):
    result, reports, out = runs["fix"]
    errors = {r["error"] for r in reports}
    assert len(errors) == 1 and all(r["error_type"] == "CheckpointAborted" and r["is_oserror"] for r in reports)
    assert errors.pop().startswith("checkpoint aborted at 'save_state': rank(s) 1: OSError: [Errno 28] No space left")
    for r in reports:
        assert r["complete"] == ["checkpoint_1", "checkpoint_2"]  # total_limit=2 kept, the failed 3rd unpublished
        assert [name for name in r["checkpoints"] if not name.startswith("checkpoint_3.incomplete-")] == \
            ["checkpoint_1", "checkpoint_2"]

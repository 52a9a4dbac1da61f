"""`install` on a real Accelerate job of several processes: MULTI_CPU (DDP over gloo) and FSDP2
(Accelerate's own path, on CPU), two ranks, Accelerate's automatic checkpoint naming with
total_limit (tests/jobs/accelerate_ddp_job.py)."""

import json

import pytest

from support.paths import JOBS

pytestmark = pytest.mark.slow


def ddp_job(tmp_path, mode, *extra):
    from ckptdoctor.repro.launcher import launch

    out = tmp_path / "-".join((mode, *extra))
    out.mkdir()
    result = launch([str(JOBS / "accelerate_ddp_job.py"), str(out), mode, *extra], 2, out / "job.log", timeout_s=300,
                    grace_s=10, env={"ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1",
                                     "CKPTDOCTOR_GROUP_TIMEOUT_S": "120"})
    return result, [json.loads((out / f"rank{r}.json").read_text()) for r in range(2) if (out / f"rank{r}.json").exists()], out


@pytest.fixture(scope="module", params=["ddp", "fsdp2"])
def runs(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(request.param)
    extra = ("fsdp2",) if request.param == "fsdp2" else ()
    return request.param, {mode: ddp_job(tmp, mode, *extra) for mode in ("stock", "fix")}


def test_two_ranks_save_and_resume_the_newest_as_stock_does(runs):
    layout, runs = runs
    for mode in ("stock", "fix"):
        result, reports, out = runs[mode]
        assert result.returncodes == [0, 0], (out / "job.log").read_text()[-3000:]
        for r in reports:
            assert r["distributed_type"] == {"ddp": "DistributedType.MULTI_CPU", "fsdp2": "DistributedType.FSDP"}[layout]
            assert r["loaded"] == r["saved"] != r["moved"]  # the newest checkpoint, bit for bit
    assert [r["iteration"] for r in runs["fix"][1]] == [r["iteration"] for r in runs["stock"][1]] == [3, 3]
    assert runs["stock"][1][0]["checkpoints"] == ["checkpoint_1", "checkpoint_2"]
    if layout == "fsdp2":  # every save went through DCP, with the fix's writer (its index beside .metadata)
        newest = runs["fix"][2] / "project" / "checkpoints" / "checkpoint_2"
        assert sorted(p.parent.name for p in newest.glob("*/.ckptdoctor-index")) == ["optimizer_0",
                                                                                      "pytorch_model_fsdp_0"]


def test_a_save_failing_on_one_rank_is_one_error_on_both_and_keeps_k_complete_checkpoints(runs):
    result, reports, out = runs[1]["fix"]
    errors = {r["error"] for r in reports}
    assert len(errors) == 1 and all(r["error_type"] == "CheckpointAborted" and r["is_oserror"] for r in reports)
    assert errors.pop().startswith("checkpoint aborted at 'save_state': rank(s) 1: OSError: [Errno 28] No space left")
    for r in reports:
        assert r["complete"] == ["checkpoint_1", "checkpoint_2"]  # total_limit=2 kept, the failed 3rd unpublished
        assert [name for name in r["checkpoints"] if not name.startswith("checkpoint_3.incomplete-")] == \
            ["checkpoint_1", "checkpoint_2"]


def whole(checkpoint) -> bool:
    """Every file of the two ranks' save is there (what stock's own load needs)."""
    return all((checkpoint / name).is_file() for name in ("model.safetensors", "optimizer.bin", "random_states_0.pkl",
                                                          "random_states_1.pkl", "custom_checkpoint_0.pkl"))


def test_a_rank_killed_in_a_save_leaves_k_complete_checkpoints_where_stock_leaves_k_minus_1(tmp_path):
    """SIGKILL (a real one) of rank 1 at the start of the third save, total_limit=2."""
    left = {}
    for mode in ("stock", "fix"):
        result, _, out = ddp_job(tmp_path, mode, "kill")
        assert result.returncodes[1] == -9, (out / "job.log").read_text()[-2000:]
        root = out / "project" / "checkpoints"
        left[mode] = sorted(p.name for p in root.iterdir() if whole(p) and ".incomplete-" not in p.name)
    assert left["stock"] == ["checkpoint_1"]                       # stock deleted checkpoint_0 first
    assert left["fix"] == ["checkpoint_0", "checkpoint_1"]         # ours removes only after a publish

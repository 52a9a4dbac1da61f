"""Async saves (fix/background.py) on real Accelerate FSDP2 jobs with CPU offload, 4 gloo ranks
(tests/jobs/background_job.py, CKPTDOCTOR_ASYNC=1 with `install`): the training loop goes on while
a save is written from its host copy, every later checkpoint call and the process's end wait for
it, and a background failure is the same CheckpointAborted on every rank at the next call."""

import json
import re
import signal
import subprocess
import uuid
from pathlib import Path

import pytest

from ckptdoctor.fix.publish import COMPLETE_MARKER, INCOMPLETE, find_latest, is_complete

from support.faults import small_tmpfs
from support.paths import JOBS

pytestmark = pytest.mark.slow
KNOBS = {"CKPTDOCTOR_ASYNC": "1", "CKPTDOCTOR_GROUP_TIMEOUT_S": "300", "CKPTDOCTOR_LOST_RANK_S": "6"}


def background_job(out: Path, scenario: str, *extra: str, env=None, preloaded=None):
    """4 ranks; a rank still running 30 s after another ended is torn down (and listed as such):
    every rank must end on its own, far within the checkpoint group's 300 s."""
    from ckptdoctor.repro.launcher import launch

    out.mkdir(parents=True, exist_ok=True)
    result = launch([str(JOBS / "background_job.py"), str(out), scenario, *extra], 4, out / "job.log",
                    timeout_s=240, grace_s=30, env={**KNOBS, **(env or {})}, preloaded=preloaded)
    reports = {r["rank"]: r for r in (json.loads(p.read_text()) for p in sorted(out.glob("rank*.json")))}
    return result, reports


def dcp_checkpoints(step: Path) -> list[str]:
    return sorted(json.loads((step / COMPLETE_MARKER).read_text())["dcp_checkpoints"])


@pytest.mark.parametrize("ending", ["exit", "sigterm"])
def test_training_goes_on_while_a_save_is_written_from_its_copy_and_the_end_of_the_process_waits(tmp_path, ending):
    """step-1 is saved, the parameters and Adam's state change while it is in flight (and a barrier
    runs on the training group), step-2 waits for it, step-1 loads back bit for bit; step-3 is still
    in flight when the process ends (normally, or by SIGTERM) and is published all the same."""
    result, reports = background_job(tmp_path, "roundtrip", *(["sigterm"] if ending == "sigterm" else []))
    expected = [0] * 4 if ending == "exit" else [-signal.SIGTERM] * 4
    assert result.returncodes == expected and result.torn_down == [], (result.returncodes, reports)
    assert {r["status"] for r in reports.values()} == {"ended"}, reports
    for r in reports.values():
        assert r["in_flight_after_return"] and r["in_flight_at_barrier"] and r["in_flight_at_end"], r
        assert r["loaded"] == r["saved"] != r["step3"]  # the copy was taken at save_state, not at the write
        assert r["host_copy"] > 0
    assert len({r["saved"] for r in reports.values()}) == 4  # each rank's own shards
    ckpt = tmp_path / "ckpt"
    for step in ("step-1", "step-2", "step-3"):
        assert is_complete(ckpt / step) and dcp_checkpoints(ckpt / step) == ["optimizer_0", "pytorch_model_fsdp_0"]
    assert find_latest(ckpt) == ckpt / "step-3"
    assert not [p for p in ckpt.iterdir() if INCOMPLETE in p.name]
    log = (tmp_path / "job.log").read_text()
    assert log.count("in the background: training waited") == 3, log[-3000:]


def test_a_save_that_fails_in_the_background_is_the_same_error_on_every_rank_at_the_next_call(tmp_path):
    """Real fault: OUT/ckpt is a 1.2 MB tmpfs; step-1 (0.9 MB) fits, step-2's DCP data does not."""
    out = tmp_path / "nospace"
    with small_tmpfs(out / "ckpt", "1200k"):
        result, reports = background_job(out, "nospace")
        latest = find_latest(out / "ckpt")
        incomplete = [p.name for p in (out / "ckpt").iterdir() if INCOMPLETE in p.name]
    assert result.returncodes == [0] * 4 and result.torn_down == [], (result.returncodes, reports)
    assert {r["error_type"] for r in reports.values()} == {"CheckpointAborted"}, reports
    assert len({r["error"] for r in reports.values()}) == 1, [r["error"] for r in reports.values()]
    error = reports[0]["error"]
    # every rank aborts with one reason. Which ranks' writes fail in DCP is a race on the shared
    # tmpfs (a rank's file can land whole before another's fills it; CI saw 0-2 once): at least one.
    # Torch's writer says ENOSPC, or, when the zip writer's short write hits first, "unexpected pos".
    assert re.match(r"the background save failed, nothing of it was published: checkpoint aborted at "
                    r"'save_state \(background\)': rank\(s\) 0-3: in DCP on rank\(s\) [0-3][-,0-3]*: ", error), error
    assert "No space left on device" in error or "unexpected pos" in error, error
    assert {r["latest"] for r in reports.values()} == {str(out / "ckpt" / "step-1")} and latest == out / "ckpt" / "step-1"
    assert incomplete and all(name.startswith("step-2" + INCOMPLETE) for name in incomplete)


def test_a_rank_killed_while_its_save_is_in_flight_aborts_the_others_by_name_and_step_1_still_counts(tmp_path):
    """Each survivor names the dead rank after watching the heartbeats for 3 intervals; a lost-rank
    window that short (6 s) would make rank 0, still waiting for a survivor in the planner's
    exchange, leave by the lost-rank rule (exit 75) first: 30 s here."""
    result, reports = background_job(tmp_path, "kill", env={"CKPTDOCTOR_LOST_RANK_S": "30"})
    assert result.returncodes[2] == -signal.SIGKILL
    survivors = [0, 1, 3]
    assert [result.returncodes[r] for r in survivors] == [0] * 3 and result.torn_down == [], result.returncodes
    assert all(reports[r]["in_flight_before_kill"] for r in survivors)
    assert {reports[r]["error_type"] for r in survivors} == {"CheckpointAborted"}, reports
    for r in survivors:
        assert "rank(s) 2 left the checkpoint" in reports[r]["error"], reports[r]["error"]
    assert find_latest(tmp_path / "ckpt") == tmp_path / "ckpt" / "step-1"
    assert not (tmp_path / "ckpt" / "step-2").exists()


@pytest.fixture
def memory_cgroup():
    """A real memory cgroup (v1) the job's ranks join; its limit is set inside the job."""
    root = Path("/sys/fs/cgroup/memory")
    group = root / f"ckptdoctor-test-{uuid.uuid4().hex[:8]}"
    try:
        group.mkdir()
    except OSError as error:
        pytest.skip(f"cannot make a memory cgroup here ({error})")
    try:
        yield group
    finally:
        for pid in (group / "cgroup.procs").read_text().split():
            subprocess.run(["kill", "-9", pid], capture_output=True)
        group.rmdir()


def test_the_first_async_save_is_refused_in_one_line_when_the_node_cannot_hold_the_copy(tmp_path, memory_cgroup):
    # fresh interpreters: a rank forked from the zygote shares torch's pages, which the cgroup it
    # joins does not count, and the job's limit (its usage + 8 MiB) would then kill it
    result, reports = background_job(tmp_path, "memory", env={"CKD_CGROUP": str(memory_cgroup)}, preloaded=False)
    assert result.returncodes == [0] * 4, (result.returncodes, reports)
    assert {r["error_type"] for r in reports.values()} == {"CheckpointAborted"}, reports
    assert len({r["error"] for r in reports.values()}) == 1
    error = reports[0]["error"]
    assert "check host memory for the async copy" in error and "x 4 rank(s)" in error and \
        f"memory cgroup {memory_cgroup}" in error and "nothing was saved" in error, error
    assert "\n" not in error
    assert {tuple(r["written"]) for r in reports.values()} == {()}  # not even a staging directory

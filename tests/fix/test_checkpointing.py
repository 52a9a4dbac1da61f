"""ScalableCheckpointing (fix/checkpointing.py) on real multi-process gloo jobs: a save published whole,
ranks lost, frozen or failing, resume, and what it refuses. The protocols it orchestrates have
their own tests (test_publish.py, test_heartbeat.py, test_adapters.py, test_publish_crashes.py)."""

import json
import re

import pytest

from ckptdoctor.fix.publish import (COMPLETE_MARKER, INCOMPLETE, WRITING_MARKER, find_latest, is_complete)

from support.faults import small_tmpfs
from support.polling import wait_for
from support.paths import JOBS


@pytest.mark.slow
def test_a_rank_killed_mid_save_aborts_the_others_by_name_and_the_previous_checkpoint_still_loads(tmp_path):
    from ckptdoctor.repro.config import TrainingConfig
    from ckptdoctor.repro.launcher import launch
    from ckptdoctor.check.mova_shape import MovaShape
    from ckptdoctor.repro.worker import WorkerSpec

    job = JOBS / "kill_job.py"
    (tmp_path / "results").mkdir()
    spec = WorkerSpec(TrainingConfig(world_size=4, max_steps=2, save_interval=1), MovaShape(),
                      str(tmp_path / "checkpoints"), str(tmp_path / "results"), checkpoint_deadline_s=600.0,
                      fix=True)
    spec_path = tmp_path / "spec.json"
    spec_path.write_text(spec.to_json())
    result = launch([str(job), "train", str(spec_path), "2"], 4, tmp_path / "train.log", timeout_s=600, grace_s=60)
    log = (tmp_path / "train.log").read_text()
    assert result.returncodes[2] == 9 and all(rc != 0 for rc in result.returncodes), log[-3000:]
    assert result.torn_down == [], "survivors had to be killed: they did not fail on their own"
    reports = {r: json.loads((tmp_path / "results" / f"rank{r}.json").read_text()) for r in (0, 1, 3)}
    for rank, report in reports.items():
        assert report["status"] == "failed" and report["error_type"] == "CheckpointAborted", report.get("error")
        assert "rank(s) 2 left the checkpoint" in report["error"]
    # no time bound: the launcher tore no survivor down, so each failed on its own, naming rank 2
    from ckptdoctor.diagnose.logs import diagnose

    diagnosis = diagnose([tmp_path / "train.log"])  # the fault test's own log, read by the diagnoser
    assert diagnosis["error"] == "peer-closed" and set(diagnosis["ranks"]) <= {0, 1, 3}
    assert diagnosis["causes"][0]["cause"].startswith("another rank died")
    root = tmp_path / "checkpoints"
    assert find_latest(root, "accelerator") == root / "step-1" / "accelerator"
    assert not (root / "step-2" / "accelerator").exists()
    assert not any(p.name.startswith("accelerator") for p in (root / "step-2").iterdir()
                   if INCOMPLETE not in p.name), "nothing of the interrupted save is published"
    resumed = launch([str(job), "resume", str(spec_path)], 4, tmp_path / "resume.log", timeout_s=600)
    assert resumed.returncodes == [0] * 4, (tmp_path / "resume.log").read_text()[-3000:]
    assert json.loads((tmp_path / "results" / "resume0.json").read_text())["loaded"].endswith("step-1/accelerator")


@pytest.mark.slow
def test_training_resumed_from_a_checkpoint_repeats_the_uninterrupted_losses_bit_exactly(tmp_path):
    import shutil

    from ckptdoctor.repro.config import TrainingConfig
    from ckptdoctor.repro.launcher import launch
    from ckptdoctor.check.mova_shape import MovaShape
    from ckptdoctor.repro.worker import WorkerSpec

    def run(name, resume_step=None):
        results = tmp_path / name / "results"
        results.mkdir(parents=True)
        spec = WorkerSpec(TrainingConfig(world_size=4, max_steps=3, save_interval=1), MovaShape(),
                          str(tmp_path / name / "checkpoints"), str(results), checkpoint_deadline_s=600.0, fix=True,
                          resume_step=resume_step)
        (tmp_path / name / "spec.json").write_text(spec.to_json())
        job = launch(["-m", "ckptdoctor.repro.worker", str(tmp_path / name / "spec.json")], 4, tmp_path / name / "job.log",
                     timeout_s=900)
        assert job.returncodes == [0] * 4, (tmp_path / name / "job.log").read_text()[-3000:]
        return [json.loads((results / f"rank{r}.json").read_text())["losses"] for r in range(4)]

    straight = run("straight")
    (tmp_path / "resumed" / "checkpoints").mkdir(parents=True)
    shutil.copytree(tmp_path / "straight" / "checkpoints" / "step-1", tmp_path / "resumed" / "checkpoints" / "step-1")
    resumed = run("resumed", resume_step=1)
    assert all(len(losses) == 3 for losses in straight)
    assert resumed == [losses[1:] for losses in straight]  # steps 2 and 3, every rank, bit for bit
    assert straight[0][1] != straight[0][2]  # the losses move: equality is not trivial


# -- ScalableCheckpointing on real gloo ranks, with a stand-in accelerator (jobs/checkpointing_job.py)


KNOBS = {"CKPTDOCTOR_GROUP_TIMEOUT_S": "300", "CKPTDOCTOR_LOST_RANK_S": "6"}


def checkpoint_job(tmp_path, fault, target=-1, world=4, **launch_kwargs):
    from ckptdoctor.repro.launcher import launch

    out = tmp_path / fault
    out.mkdir(exist_ok=True)
    env = {**KNOBS, **launch_kwargs.pop("env", {})}  # the job passes no keyword: the environment tunes it
    result = launch([str(JOBS / "checkpointing_job.py"), str(out), fault, str(target)], world, out / "job.log",
                    timeout_s=launch_kwargs.pop("timeout_s", 300), env=env, **launch_kwargs)
    reports = [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]
    return result, {r["rank"]: r for r in reports}, out


@pytest.mark.slow
@pytest.mark.parametrize("publish", ["rename", "in_place"])
def test_a_save_publishes_one_complete_step(tmp_path, publish):
    result, reports, out = checkpoint_job(tmp_path, "none", env={"CKPTDOCTOR_PUBLISH": publish})
    assert result.returncodes == [0] * 4 and {r["status"] for r in reports.values()} == {"ok"}
    assert {tuple(r["settings"].values()) for r in reports.values()} == {(300.0, 6.0, "exit", publish)}  # env
    step = out / "ckpt" / "step-1" / "accelerator"
    assert {r["latest"] for r in reports.values()} == {str(step)}  # every rank: the marked step
    assert json.loads((step / COMPLETE_MARKER).read_text())["mode"] == publish
    assert [p.name for p in (out / "ckpt").rglob("*") if INCOMPLETE in p.name or p.name == WRITING_MARKER] == []
    saved = [line for line in (out / "job.log").read_text().splitlines() if "ckptdoctor: saved " in line]
    assert len(saved) == 1 and f"saved {step} in " in saved[0], saved  # one line, rank 0's, through logging
    assert re.search(r"\((\w+ \d+\.\d s, )*save_state \d+\.\d s.*\), 2 DCP checkpoint\(s\), \d+(\.\d)? K?B$", saved[0]), saved[0]
    assert is_complete(step) and find_latest(out / "ckpt", "accelerator") == step
    assert sorted(json.loads((step / COMPLETE_MARKER).read_text())["dcp_checkpoints"]) == \
        ["optimizer_0", "pytorch_model_fsdp_0"]


@pytest.mark.slow
def test_a_frozen_rank_makes_every_other_rank_leave_within_seconds_and_nothing_is_published(tmp_path):
    """SIGSTOP: the process keeps its connections open, as a node that vanished without a FIN.
    Before: the others waited for the checkpoint group's timeout (3 h by default)."""
    from ckptdoctor.fix.heartbeat import EXIT_LOST_RANK

    result, reports, out = checkpoint_job(tmp_path, "sigstop", target=2, grace_s=20)  # then the frozen one is killed
    survivors = [r for r in range(4) if r != 2]
    assert [result.returncodes[r] for r in survivors] == [EXIT_LOST_RANK] * 3, result.returncodes
    assert result.torn_down == [2]  # only the frozen one had to be killed
    log = (out / "job.log").read_text()
    assert log.count("rank(s) 2 stopped answering") >= 1 and "nothing was published" in log
    assert find_latest(out / "ckpt", "accelerator") is None
    assert not (out / "ckpt" / "step-1" / "accelerator").exists()


@pytest.mark.slow
def test_after_install_the_accelerators_own_save_and_load_go_through_the_fix(tmp_path):
    """The minimal integration on real gloo ranks: the stand-in accelerator's own save_state
    publishes a complete, indexed checkpoint on the checkpoint group, and its load_state reads it back."""
    result, reports, out = checkpoint_job(tmp_path, "installed")
    assert result.returncodes == [0] * 4 and {r["status"] for r in reports.values()} == {"ok"}, reports
    step = out / "ckpt" / "step-1" / "accelerator"
    assert all(r["install_twice_same"] and r["returned"] == str(step) and r["state_is_the_saved_one"]
               for r in reports.values())
    assert is_complete(step) and sorted(p.parent.name for p in step.glob("*/.ckptdoctor-index")) == \
        ["optimizer_0", "pytorch_model_fsdp_0"]  # written by the fix's writer
    log = (out / "job.log").read_text()
    assert log.count(f"ckptdoctor: saved {step} in ") == log.count(f"ckptdoctor: loaded {step} in ") == 1
    assert reports[0]["no_dir"] == ("CkptDoctorError: save_state() needs an output_dir, or Accelerate's "
                                    "automatic_checkpoint_naming in the project configuration; nothing was saved")


@pytest.mark.slow
@pytest.mark.parametrize("heartbeat", ["process", "thread"])
def test_a_rank_busy_holding_the_gil_past_the_window_is_alive_with_the_process_heartbeat(tmp_path, heartbeat):
    """Rank 2's main thread keeps the GIL for 10 s in its local plan, the lost-rank window is
    6 s. Its heartbeat thread cannot post; its forked child (the default) does, and the save
    completes. With the thread alone (CKPTDOCTOR_HEARTBEAT=thread) the job would die of it:
    the report's symptom with a new cause, shown here so that this test can fail."""
    from ckptdoctor.fix.heartbeat import EXIT_LOST_RANK

    env = {"HOLD_GIL_S": "10", "CKPTDOCTOR_HEARTBEAT": heartbeat}
    result, reports, out = checkpoint_job(tmp_path, "gil", target=2, env=env, grace_s=60)
    if heartbeat == "process":
        assert result.returncodes == [0] * 4 and {r["status"] for r in reports.values()} == {"ok"}
        assert is_complete(out / "ckpt" / "step-1" / "accelerator")
    else:
        assert EXIT_LOST_RANK in result.returncodes and "rank(s) 2 stopped answering" in (out / "job.log").read_text()
        assert find_latest(out / "ckpt", "accelerator") is None


@pytest.mark.slow
@pytest.mark.parametrize("agent_store, named", [
    (True, "rank(s) 0 left the checkpoint"),
    (False, "rank 0 (its process hosts the job's store) left the checkpoint"),
])
def test_the_survivors_name_a_dead_rank_0_wherever_the_store_lives(tmp_path, agent_store, named):
    """Under torchrun the agent hosts the job's store: it outlives rank 0, and the heartbeats tell
    who left. Under env:// without the agent (srun, mpirun, mp.spawn) the store dies with rank 0's
    process; before, the survivors then got DistNetworkError: Broken pipe."""
    result, reports, out = checkpoint_job(tmp_path, "exit", target=0, agent_store=agent_store, grace_s=60)
    assert result.returncodes[0] == 9 and result.torn_down == []
    for rank in (1, 2, 3):
        assert reports[rank]["error_type"] == "CheckpointAborted", reports[rank]
        assert named in reports[rank]["error"]
    assert find_latest(out / "ckpt", "accelerator") is None


@pytest.mark.slow
def test_a_dcp_save_that_bypassed_the_fix_is_not_published(tmp_path):
    result, reports, out = checkpoint_job(tmp_path, "bound", world=2)
    assert {r["error_type"] for r in reports.values()} == {"CheckpointAborted"}
    assert all("saved without ckptdoctor's planner" in r["error"] for r in reports.values())
    assert find_latest(out / "ckpt", "accelerator", legacy=False) is None


@pytest.mark.slow
def test_every_rank_resumes_from_the_step_rank_0_chose_or_none_does(tmp_path):
    result, reports, out = checkpoint_job(tmp_path, "blind", target=3)
    assert {r["error_type"] for r in reports.values()} == {"CheckpointAborted"}
    assert all("complete': rank(s) 3: " in r["error"] and "is not a complete checkpoint" in r["error"]
               for r in reports.values())


@pytest.mark.slow
def test_a_job_never_takes_a_save_begun_after_its_own_start_for_a_dead_ones_leftovers(tmp_path):
    """Two jobs sharing a save root (unsupported, but it happens), ordered so that the race is
    the same at every run: job B is set up; job A then writes step-1 into its staging and holds
    before publishing; B saves step-1 and publishes, then removes dead saves' leftovers beside it;
    A publishes. A's staging began after B's checkpointing did, so B must leave it: a staging
    is dead only when begun before this job's checkpointing, or failed in it. (When every save
    older than B's own counted as dead, B deleted A's files and A failed at publish.) Read from
    every rank's own report, not the jobs' exit codes (a job reports a failure and exits 0)."""
    import threading

    from ckptdoctor.repro.launcher import launch

    results, shared = {}, tmp_path / "shared"

    def start(name, hold):
        (tmp_path / name).mkdir()
        thread = threading.Thread(target=lambda: results.__setitem__(name, launch(
            [str(JOBS / "checkpointing_job.py"), str(tmp_path / name), "none"], 2, tmp_path / name / "job.log",
            timeout_s=300, env={**KNOBS, "CKPTDOCTOR_TEST_CKPT_ROOT": str(shared), "TEST_HOLD": hold})))
        thread.start()
        return thread

    def reached(name, point):
        assert wait_for(lambda: (tmp_path / name / point).exists(), 120), (tmp_path / name / "job.log").read_text()

    b = start("b", "before-save")
    reached("b", "ready")  # B's ScalableCheckpointing exists
    a = start("a", "before-publish")
    reached("a", "written")  # A's staging holds step-1, unpublished
    (tmp_path / "b" / "go").touch()
    b.join()
    assert [p.name.startswith("accelerator.incomplete-") for p in (shared / "step-1").iterdir()
            if p.name != "accelerator"] == [True]  # B published beside A's staging and left it
    (tmp_path / "a" / "go").touch()
    a.join()
    assert results["a"].returncodes == results["b"].returncodes == [0, 0]
    reports = {name: [json.loads(p.read_text()) for p in sorted((tmp_path / name).glob("rank*.json"))]
               for name in ("a", "b")}
    assert {name: [r["status"] for r in ranks] for name, ranks in reports.items()} == \
        {"a": ["ok", "ok"], "b": ["ok", "ok"]}, {n: [r.get("error") for r in rs] for n, rs in reports.items()}
    step = shared / "step-1" / "accelerator"
    assert is_complete(step) and [p.name for p in step.parent.iterdir()] == ["accelerator"]  # A's, nothing else


def assert_the_same_abort_on_every_rank_within_seconds(result, reports, fragment):
    """The rule: a failure on any rank is the same CheckpointAborted on every rank, and every
    rank ends on its own well before the checkpoint group's timeout (300 s in the job)."""
    assert result.returncodes == [0] * 4 and result.torn_down == [], result.returncodes
    assert {r["error_type"] for r in reports.values()} == {"CheckpointAborted"}, reports
    assert len({r["error"] for r in reports.values()}) == 1, [r["error"] for r in reports.values()]
    assert fragment in reports[0]["error"], reports[0]["error"]  # torn_down == []: every rank ended on its own


@pytest.mark.slow
def test_a_full_disk_at_rank_0s_staging_directory_aborts_every_rank_at_once(tmp_path):
    """Real fault: the save root is a tmpfs with no inode left, so only rank 0's mkdir fails.
    Before: ranks 1-3 waited in the next barrier for the group's timeout."""
    out = tmp_path / "full-begin"
    with small_tmpfs(out / "full", "1m,nr_inodes=8") as full:
        (full / "ckpt").mkdir()
        filler = 0
        with pytest.raises(OSError):
            while True:
                (full / f"f{filler}").write_bytes(b"")
                filler += 1
        result, reports, _ = checkpoint_job(tmp_path, "full-begin")
    assert_the_same_abort_on_every_rank_within_seconds(
        result, reports, "checkpoint aborted at 'create the staging directory': rank 0: OSError: [Errno 28]")


@pytest.mark.slow
def test_a_marker_that_cannot_be_written_aborts_every_rank_and_publishes_nothing_complete(tmp_path):
    """INJECTED fault (rank 0's json.dump of the marker raises ENOSPC, after the rename)."""
    result, reports, out = checkpoint_job(tmp_path, "marker-fails")
    assert_the_same_abort_on_every_rank_within_seconds(
        result, reports, "checkpoint aborted at 'publish': rank 0: OSError: [Errno 28] No space left on device")
    assert not is_complete(out / "ckpt" / "step-1" / "accelerator")


@pytest.mark.slow
def test_both_integrations_on_one_accelerator_are_refused_in_one_line_in_either_order(tmp_path):
    result, reports, out = checkpoint_job(tmp_path, "double")
    assert result.returncodes == [0] * 4 and {r["status"] for r in reports.values()} == {"ok"}, reports
    assert {r["install_then_patch"] for r in reports.values()} == {
        "CkptDoctorError: ckptdoctor: this Accelerator already saves through ckptdoctor.install (level 1, one call "
        "after prepare); refusing to add ScalableCheckpointing (level 2, the full patch or a trainer's own calls) as "
        "well: keep one of the two"}
    assert {r["patch_then_install"] for r in reports.values()} == {
        "CkptDoctorError: ckptdoctor: this Accelerator already saves through ScalableCheckpointing (level 2, the full "
        "patch or a trainer's own calls); refusing to add ckptdoctor.install (level 1, one call after prepare) as "
        "well: keep one of the two"}
    step = out / "ckpt" / "step-1" / "accelerator"
    assert {r["still_saves"] for r in reports.values()} == {str(step)} and is_complete(step)
    log = (out / "job.log").read_text()
    for rank in range(4):  # every rank names its integration at startup
        assert f"ckptdoctor: rank {rank} of 4 saves through ckptdoctor.install (level 1" in log
        assert f"ckptdoctor: rank {rank} of 4 saves through ScalableCheckpointing (level 2" in log


@pytest.mark.slow
def test_a_rank_whose_settings_differ_stops_every_rank_at_construction_naming_it(tmp_path):
    result, reports, out = checkpoint_job(tmp_path, "settings", target=2)
    assert result.returncodes == [0] * 4 and len(reports) == 4, reports
    assert {r["construction"] for r in reports.values()} == {
        "CheckpointAborted: checkpoint aborted at 'agree on the settings': rank(s) 2: settings differ from rank 0's: "
        "publish='in_place' (rank 0: 'rename') (set the same CKPTDOCTOR_* variables and keywords on every node); "
        "nothing was written"}
    assert all(r["written"] == [] for r in reports.values())


@pytest.mark.slow
def test_a_save_rank_0_cannot_derive_takes_the_owned_path_by_agreement_is_published_and_loaded_back(tmp_path):
    """Rank 1's model holds a key the others do not. Stock saves it; so does the fix, by itself:
    the planner's agreement sends that save to the owned path, with one warning, nothing retried."""
    result, reports, out = checkpoint_job(tmp_path, "differ", target=1)
    assert result.returncodes == [0] * 4 and {r["status"] for r in reports.values()} == {"ok"}, reports
    assert all(r["state_is_the_saved_one"] for r in reports.values())  # rank 1's extra key, bit for bit
    step = out / "ckpt" / "step-1" / "accelerator"
    assert is_complete(step)
    log = (out / "job.log").read_text()
    assert log.count("so the save takes the owned path") == 1  # rank 0, once: the model save only
    assert "rank(s) 1 hold a different state dict structure than rank 0" in log


@pytest.mark.slow
def test_a_planner_other_than_accelerates_is_refused_on_every_rank_and_nothing_is_published(tmp_path):
    result, reports, out = checkpoint_job(tmp_path, "planner")
    assert_the_same_abort_on_every_rank_within_seconds(
        result, reports, "Accelerate passed a OwnPlanner; ckptdoctor replaces only DefaultSavePlanner")
    assert find_latest(out / "ckpt", "accelerator") is None and not (out / "ckpt" / "step-1" / "accelerator").exists()


@pytest.mark.slow
def test_on_lost_rank_log_names_the_frozen_rank_and_leaves_the_wait_to_the_group_timeout(tmp_path):
    """CKPTDOCTOR_ON_LOST_RANK=log: the verdict is logged, nobody exits 75, and the survivors end at
    the checkpoint group's own timeout (20 s here), each with its own failure, nothing published."""
    from ckptdoctor.fix.heartbeat import EXIT_LOST_RANK

    result, reports, out = checkpoint_job(tmp_path, "sigstop", target=2, grace_s=5, timeout_s=150, env={
        "CKPTDOCTOR_ON_LOST_RANK": "log", "CKPTDOCTOR_GROUP_TIMEOUT_S": "20"})  # the frozen one: torn down once
    assert result.torn_down == [2]  # the others ended (torchrun would wait for it, an operator would kill it)
    survivors = [r for r in range(4) if r != 2]
    assert EXIT_LOST_RANK not in result.returncodes and [result.returncodes[r] for r in survivors] == [0] * 3
    log = (out / "job.log").read_text()
    assert "rank(s) 2 stopped answering for 6 s; the checkpoint cannot finish" in log
    assert {reports[r]["status"] for r in survivors} == {"failed"} and 2 not in reports
    assert find_latest(out / "ckpt", "accelerator") is None

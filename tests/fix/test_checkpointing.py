"""ScalableCheckpointing: publication, what counts as a checkpoint, heartbeats, LoRA weights
(in one process), and real multi-process saves that lose a rank."""

import json
import os
import re

import pytest
import torch

from ckptdoctor.errors import CkptDoctorError
from ckptdoctor.fix import heartbeat, publish as publishing
from ckptdoctor.fix.adapters import adapter_state_dict
from ckptdoctor.fix.agreement import OK
from ckptdoctor.fix.heartbeat import Heartbeat
from ckptdoctor.fix.publish import newest_loadable, publish_and_tidy
from ckptdoctor.fix.publish import (COMPLETE_MARKER, INCOMPLETE, REPLACED, WRITING_MARKER, Staging, counts_as_checkpoint,
                                    find_latest, is_complete, legacy_complete, new_token, publish)
from ckptdoctor.fix.storage import ScalableFileSystemWriter

from support.faults import small_tmpfs
from support.polling import wait_for
from support.paths import JOBS


def dcp_dir(path, metadata=True):
    path.mkdir(parents=True, exist_ok=True)
    (path / "__0_0.distcp").write_bytes(b"x")
    if metadata:
        (path / ".metadata").write_bytes(b"m")
    return path


def staged(root, name="step-1", token="ab12", checkpoints=("accelerator/optimizer_0",)):
    """A staging directory holding DCP checkpoints, and its open publication."""
    opened = Staging(root / name, token)
    for c in checkpoints:
        dcp_dir(opened.staging() / c)
        opened.checkpoints.append(c)
    return opened.staging(), opened


def test_publish_renames_then_marks_and_the_result_counts(tmp_path):
    staging, opened = staged(tmp_path)
    assert publish(staging, opened) == OK
    final = tmp_path / "step-1"
    assert not staging.exists() and is_complete(final)
    assert json.loads((final / COMPLETE_MARKER).read_text())["dcp_checkpoints"] == ["accelerator/optimizer_0"]


def test_the_marker_is_written_after_the_rename_never_inside_a_staging_directory(tmp_path, monkeypatch):
    """On an object-store mount a directory rename copies object by object: a marker copied
    with a partial directory would publish it. So at rename time no marker may exist."""
    staging, opened = staged(tmp_path)
    seen = []
    real_replace = os.replace
    monkeypatch.setattr(publishing.os, "replace",
                        lambda a, b: (seen.append((a, (a / COMPLETE_MARKER).exists())), real_replace(a, b))[1])
    publish(staging, opened)
    assert seen == [(staging, False)]


def test_a_crash_between_moving_the_old_step_aside_and_the_new_marker_loses_no_step(tmp_path, monkeypatch):
    old, old_opened = staged(tmp_path, token="0001")
    publish(old, old_opened)  # step-1, complete
    new, new_opened = staged(tmp_path, token="0002")
    real_replace = os.replace
    calls = []

    def crash_on_second(a, b):
        calls.append(a)
        if len(calls) == 2:
            raise OSError("the node died here")
        return real_replace(a, b)
    monkeypatch.setattr(publishing.os, "replace", crash_on_second)
    with pytest.raises(OSError):
        publish(new, new_opened)
    assert not (tmp_path / "step-1").exists()  # moved aside ...
    assert find_latest(tmp_path) == tmp_path / f"step-1{REPLACED}0002"  # ... and still found, complete


def test_publish_refuses_a_missing_metadata_and_a_dcp_save_that_bypassed_the_fix(tmp_path):
    staging, opened = staged(tmp_path)
    (staging / "accelerator/optimizer_0/.metadata").unlink()
    assert "have no .metadata" in publish(staging, opened)
    staging, opened = staged(tmp_path, name="step-2")
    dcp_dir(staging / "accelerator" / "pytorch_model_fsdp_0")  # saved, but not through the wrapper
    assert "saved without ckptdoctor's planner" in publish(staging, opened)
    assert not (tmp_path / "step-1").exists() and not (tmp_path / "step-2").exists()  # nothing renamed


def test_what_counts_marker_and_every_listed_metadata_or_a_whole_stock_save(tmp_path):
    staging, opened = staged(tmp_path, checkpoints=("accelerator/pytorch_model_fsdp_0", "accelerator/optimizer_0"))
    publish(staging, opened)
    step = tmp_path / "step-1"
    assert is_complete(step)
    (step / "accelerator/optimizer_0/.metadata").unlink()
    assert not is_complete(step)  # a marker alone does not count
    stock = tmp_path / "step-5" / "accelerator"
    dcp_dir(stock / "pytorch_model_fsdp_0")
    dcp_dir(stock / "optimizer_0")
    assert not legacy_complete(stock)  # no random states yet: save_state had not finished
    (stock / "random_states_0.pkl").write_bytes(b"r")
    assert legacy_complete(stock) and legacy_complete(stock.parent)
    (stock / "optimizer_0/.metadata").unlink()
    assert not legacy_complete(stock)


def test_find_latest_skips_staging_and_incomplete_steps(tmp_path):
    for step in (100, 200):
        staging, opened = staged(tmp_path, name=f"step-{step}", token=f"{step:x}")
        publish(staging, opened)
    staged(tmp_path, name="step-300")  # never committed
    unmarked = tmp_path / "step-400"
    dcp_dir(unmarked / "accelerator/optimizer_0")  # a stock save that died: no random states
    assert find_latest(tmp_path) == tmp_path / "step-200"
    assert find_latest(tmp_path, legacy=False) == tmp_path / "step-200"
    assert find_latest(tmp_path / "missing") is None
    assert all(INCOMPLETE not in p.name for p in tmp_path.iterdir() if is_complete(p))


class CountingStore:
    """A dict standing for the job's TCP store, counting requests."""

    def __init__(self):
        self.data, self.requests = {}, 0

    def set(self, key, value):
        self.requests += 1
        self.data[key] = value.encode() if isinstance(value, str) else value

    def get(self, key):
        self.requests += 1
        return self.data[key]

    def multi_get(self, keys):
        self.requests += 1
        return [self.data[k] for k in keys]


@pytest.mark.parametrize("world", [8, 2816])
def test_naming_the_ranks_that_left_costs_each_survivor_two_store_requests(world, monkeypatch):
    """Was 3N + 1 requests per survivor (one add per rank, twice, and a check per rank): at
    2,816 ranks, about 24 million in all when every survivor asks. Rank 5 died; odd ranks are
    still alive, even ranks gave up on their own."""
    store = CountingStore()
    beats = [Heartbeat(store, "p/", r, world) for r in range(world)]
    for b in beats:
        b._post("alive")
    for b in beats[2::2]:
        b.mark_aborted()
    alive = [b for b in beats[1::2] if b.rank != 5]
    moving_on = lambda s: [store.data.update({b.key(b.rank): b"alive:later"}) for b in alive]  # noqa: E731 (uncounted)
    monkeypatch.setattr(heartbeat.time, "sleep", moving_on)
    store.requests = 0
    assert beats[0].gone(wait_s=1) == [5]
    assert store.requests == 2


def test_a_rank_alive_but_unchanged_for_the_limit_is_lost_idle_and_aborted_ranks_are_not(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(heartbeat.time, "monotonic", lambda: clock[0])
    watch = heartbeat.Staleness(lost_after_s=10)
    stale = []
    for second in range(12):
        clock[0] = float(second)
        stale = watch.update({0: f"alive:{second}", 1: "alive:7", 2: "idle:3", 3: "aborted:4"})
    assert stale == [1]


def test_adapter_state_dict_gathers_sharded_adapters_and_copies_plain_ones(tmp_path):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        model = torch.nn.Module()
        model.lora_A = torch.nn.Parameter(distribute_tensor(torch.arange(6.0).reshape(3, 2), mesh, [Shard(0)]))
        model.lora_B = torch.nn.Parameter(torch.arange(4.0))
        model.base = torch.nn.Parameter(torch.ones(2))
        state = adapter_state_dict(model)
        assert list(state) == ["lora_A", "lora_B"]
        assert type(state["lora_A"]) is torch.Tensor and torch.equal(state["lora_A"], torch.arange(6.0).reshape(3, 2))
        assert state["lora_B"].data_ptr() != model.lora_B.data_ptr()  # a copy, safe from the next step
        with pytest.raises(CkptDoctorError, match="no parameter name contains"):
            adapter_state_dict(torch.nn.Linear(2, 2))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_a_rank_killed_mid_save_aborts_the_others_by_name_and_the_previous_checkpoint_still_loads(tmp_path):
    import time

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
    assert result.returncodes[2] == 9 and all(rc != 0 for rc in result.returncodes)
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
    assert re.search(r"\(save_state \d+\.\d s.*\), 2 DCP checkpoint\(s\), \d+(\.\d)? K?B$", saved[0]), saved[0]
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


def test_a_step_published_with_begin_and_commit_is_found_by_its_accelerate_subdirectory(tmp_path):
    """commit() marks the step directory, not step/accelerator: latest(root, "accelerator") used to
    skip such steps unless the legacy test happened to pass."""
    staging, opened = staged(tmp_path, name="step-4", token="0004",
                             checkpoints=("accelerator/pytorch_model_fsdp_0", "accelerator/optimizer_0"))
    publish(staging, opened)
    assert find_latest(tmp_path, "accelerator", legacy=False) == tmp_path / "step-4" / "accelerator"
    assert not counts_as_checkpoint(tmp_path / "step-4" / "acelerator")  # a misspelt subdirectory is not one
    staged_v2, opened_v2 = staged(tmp_path, name="v2-step-8", token="0008")
    publish(staged_v2, opened_v2)
    assert find_latest(tmp_path, legacy=False) == tmp_path / "v2-step-8"  # digits before the step number


def real_step(root, step, token):
    """A published step whose Accelerate state holds a real single-process DCP checkpoint."""
    import torch.distributed.checkpoint as dcp

    opened = Staging(root / f"step-{step}", token)
    dcp.save({"w": torch.full((16,), float(step))},
             storage_writer=ScalableFileSystemWriter(opened.staging() / "accelerator" / "optimizer_0"))
    opened.checkpoints.append("accelerator/optimizer_0")
    assert publish(opened.staging(), opened) == OK
    return root / f"step-{step}"


def test_latest_skips_a_step_whose_data_files_are_gone_and_takes_the_one_before(tmp_path):
    older, newer = real_step(tmp_path, 100, new_token()), real_step(tmp_path, 200, new_token())
    assert newest_loadable(tmp_path) == newer
    next((newer / "accelerator" / "optimizer_0").glob("*.distcp")).unlink()
    assert find_latest(tmp_path) == newer  # still marked complete ...
    assert newest_loadable(tmp_path) == older  # ... but not loadable: the job resumes from the step before


def test_the_next_successful_commit_removes_earlier_saves_leftovers_and_nothing_it_may_need(tmp_path):
    dead_staging = tmp_path / f"step-100{INCOMPLETE}{new_token()}"
    dead_staging.mkdir()
    kept_replaced = real_step(tmp_path, 50, new_token()).with_name(f"step-60{REPLACED}{new_token()}")
    kept_replaced.mkdir()  # step-60 exists nowhere else: its only copy stays
    redundant = tmp_path / f"step-50{REPLACED}{new_token()}"
    redundant.mkdir()  # step-50 is complete again: the copy goes
    ours = new_token()
    later_staging = tmp_path / f"step-300{INCOMPLETE}{new_token()}"  # started after ours: may be live
    later_staging.mkdir()
    opened = Staging(tmp_path / "step-200", ours)
    dcp_dir(opened.staging() / "accelerator" / "optimizer_0")
    opened.checkpoints.append("accelerator/optimizer_0")
    assert publish_and_tidy(opened.staging(), opened) == OK
    assert not dead_staging.exists() and not redundant.exists()
    assert kept_replaced.exists() and later_staging.exists() and is_complete(tmp_path / "step-200")


# -- level 1 (install): the trainer's own step directories -----------------------------------------

def level1_step(root, step, token, complete=True):
    """`<root>/step-N/` as MOVA leaves it at level 1: its own files, then install's published
    `accelerator` (complete) or a dead save's staging beside an empty `accelerator` (not)."""
    directory = root / f"step-{step}"
    directory.mkdir(parents=True)
    (directory / "trainer_state.pt").write_bytes(b"state")
    opened = Staging(directory / "accelerator", token)
    dcp_dir(opened.staging() / "optimizer_0", metadata=complete)
    opened.checkpoints.append("optimizer_0")
    if complete:
        assert publish(opened.staging(), opened) == OK
    else:
        (directory / "accelerator").mkdir()  # MOVA makes it before calling save_state
    return directory


def test_at_startup_a_step_a_save_died_in_is_set_aside_and_the_trainers_scan_finds_the_newest_complete(tmp_path):
    from ckptdoctor.fix.publish import set_aside_dead_steps

    good = level1_step(tmp_path, 4, new_token())
    dead = level1_step(tmp_path, 8, new_token(), complete=False)  # died in save_state: trainer_state.pt is there
    (tmp_path / "step-12" / "video_dit").mkdir(parents=True)  # died before trainer_state.pt (MOVA's own weights)
    stock = tmp_path / "step-2" / "accelerator"  # a whole stock save (before the fix): a checkpoint
    for name in ("pytorch_model_fsdp_0", "optimizer_0"):
        dcp_dir(stock / name)
    (stock / "random_states_0.pkl").write_bytes(b"r")
    (tmp_path / "logs-2026").mkdir()  # not named like the steps, no trace of a save: not the trainer's
    (tmp_path / "final").mkdir()
    assert set_aside_dead_steps(tmp_path) == 2
    names = sorted(p.name for p in tmp_path.iterdir())
    assert [n for n in names if n.startswith("step-") and INCOMPLETE not in n] == ["step-2", "step-4"]
    assert {n.split(INCOMPLETE)[0] for n in names if INCOMPLETE in n} == {"step-8", "step-12"}
    assert "logs-2026" in names and "final" in names and good.exists() and not dead.exists()
    moved = next(tmp_path.glob(f"step-8{INCOMPLETE}*"))
    assert (moved / "trainer_state.pt").read_bytes() == b"state"  # set aside, nothing deleted
    # MOVA's own scan (accelerate_trainer.py:111-135): the newest `step-N` directory
    steps = [int(m[1]) for p in tmp_path.iterdir() if (m := re.fullmatch(r"step-(\d+)", p.name)) and p.is_dir()]
    assert max(steps) == 4
    assert set_aside_dead_steps(tmp_path) == 0  # a second start finds nothing more


def test_a_first_save_that_died_with_no_step_complete_yet_is_set_aside_by_its_traces_alone(tmp_path):
    from ckptdoctor.fix.publish import set_aside_dead_steps

    level1_step(tmp_path, 4, new_token(), complete=False)
    (tmp_path / "run-7").mkdir()  # someone else's directory: no checkpoint, no trace
    assert set_aside_dead_steps(tmp_path) == 1
    assert sorted(p.name.split(INCOMPLETE)[0] for p in tmp_path.iterdir()) == ["run-7", "step-4"]
    assert not (tmp_path / "step-4").exists()


def test_the_next_save_removes_level1_leftovers_in_the_save_root_and_inside_its_steps(tmp_path):
    """Level 1 publishes `step-N/accelerator`: a dead save's staging sits inside its step, and a
    step set aside sits in the save root; both are beside no directory the next save publishes."""
    from ckptdoctor.fix.publish import set_aside_dead_steps

    level1_step(tmp_path, 4, new_token())
    stale = level1_step(tmp_path, 8, new_token(), complete=False)
    set_aside_dead_steps(tmp_path)
    inner = level1_step(tmp_path, 12, new_token())
    dead_inner = inner / f"accelerator{INCOMPLETE}{new_token()}"  # an earlier attempt at step-12, died
    dcp_dir(dead_inner / "optimizer_0")
    (tmp_path / "step-16").mkdir()
    opened = Staging(tmp_path / "step-16" / "accelerator", new_token())
    later = tmp_path / "step-20" / f"accelerator{INCOMPLETE}{new_token()}"  # started after ours: may be live
    later.mkdir(parents=True)
    dcp_dir(opened.staging() / "optimizer_0")
    opened.checkpoints.append("optimizer_0")
    assert publish_and_tidy(opened.staging(), opened) == OK
    leftovers = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if INCOMPLETE in p.name)
    assert leftovers == [str(later.relative_to(tmp_path))]
    assert not stale.exists() and is_complete(inner / "accelerator") and is_complete(tmp_path / "step-16" / "accelerator")


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


def test_an_in_place_save_a_dead_job_left_is_removed_and_a_live_ones_is_not(tmp_path):
    """In place, a step being written is the step itself: removing the wrong one deletes data.
    Dead: claimed (WRITING, no marker) before this job's checkpointing began, or by a save of this
    job that failed. A save claimed later is another job's, maybe live; a marked step is a step."""
    from ckptdoctor.fix.publish import remove_leftovers

    def claimed(name, token, marked=False):
        directory = tmp_path / name
        dcp_dir(directory / "accelerator" / "optimizer_0")
        (directory / WRITING_MARKER).write_text(json.dumps({"token": token}))
        if marked:
            (directory / COMPLETE_MARKER).write_text(json.dumps({"token": token, "dcp_checkpoints": []}))
        return directory

    before, failed_here = new_token(), new_token()
    dead = claimed("step-100", before)
    horizon = new_token()
    ours_failed = claimed("step-200", failed_here)  # began before the horizon too, but named as failed: gone anyway
    live = claimed("step-300", new_token())  # another job's, begun after this job's checkpointing began
    marked = claimed("step-50", before, marked=True)
    assert sorted(p.name for p in remove_leftovers(tmp_path, horizon, {failed_here})) == ["step-100", "step-200"]
    assert not dead.exists() and not ours_failed.exists() and live.exists() and marked.exists()
    assert (live / "accelerator" / "optimizer_0" / ".metadata").is_file()


@pytest.mark.slow
def test_a_save_rank_0_cannot_derive_is_retried_on_the_owned_path_published_and_loaded_back(tmp_path):
    """ScalableCheckpointing's retry (the planner alone refuses with NotDerivable): rank 1's model
    holds a key the others do not. Stock saves it; so must the fix, by itself, with one warning."""
    result, reports, out = checkpoint_job(tmp_path, "differ", target=1)
    assert result.returncodes == [0] * 4 and {r["status"] for r in reports.values()} == {"ok"}, reports
    assert all(r["state_is_the_saved_one"] for r in reports.values())  # rank 1's extra key, bit for bit
    step = out / "ckpt" / "step-1" / "accelerator"
    assert is_complete(step)
    log = (out / "job.log").read_text()
    assert log.count("rank 0 could not derive this save's metadata (") == 4  # each rank, once: the model save only
    assert "rank 1 holds a different state dict structure" in log


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

"""ScalableCheckpointing's pieces that need no process group: publication and LoRA weights."""

import pytest
import torch

from ckptdoctor.errors import CkptDoctorError
from ckptdoctor.fix.checkpointing import COMPLETE_MARKER, ScalableCheckpointing, local_adapter_state

from support.paths import JOBS


def test_latest_skips_incomplete_and_unmarked_saves(tmp_path):
    for step, marked in ((100, True), (200, True), (300, False)):
        d = tmp_path / f"step-{step}" / "accelerator"
        d.mkdir(parents=True)
        if marked:
            (d / COMPLETE_MARKER).write_text("ok\n")
    staging = tmp_path / "step-400" / "accelerator.incomplete"
    staging.mkdir(parents=True)
    (staging / COMPLETE_MARKER).write_text("ok\n")  # even a marker inside a staging dir does not count
    assert ScalableCheckpointing.latest(tmp_path) == tmp_path / "step-200" / "accelerator"
    assert ScalableCheckpointing.latest(tmp_path / "missing") is None


def test_local_adapter_state_takes_plain_lora_tensors_and_refuses_sharded_ones():
    model = torch.nn.Module()
    model.lora_A = torch.nn.Parameter(torch.arange(4.0))
    model.base = torch.nn.Parameter(torch.ones(2))
    state = local_adapter_state(model)
    assert list(state) == ["lora_A"] and torch.equal(state["lora_A"], torch.arange(4.0))
    assert state["lora_A"].data_ptr() != model.lora_A.data_ptr()  # a copy, safe from the next step
    model.lora_A.placements = ("Shard(0)",)  # what a DTensor parameter carries
    with pytest.raises(CkptDoctorError, match="sharded by FSDP"):
        local_adapter_state(model)
    with pytest.raises(CkptDoctorError, match="no parameter name contains"):
        local_adapter_state(torch.nn.Linear(2, 2))


@pytest.mark.slow
def test_a_rank_killed_mid_save_aborts_the_others_by_name_and_the_previous_checkpoint_still_loads(tmp_path):
    import json
    import time
    from pathlib import Path

    from ckptdoctor.repro.config import TrainingConfig
    from ckptdoctor.repro.launcher import launch
    from ckptdoctor.repro.model import MovaShape
    from ckptdoctor.repro.worker import WorkerSpec

    job = JOBS / "kill_job.py"
    (tmp_path / "results").mkdir()
    spec = WorkerSpec(TrainingConfig(world_size=4, max_steps=2, save_interval=1), MovaShape(),
                      str(tmp_path / "checkpoints"), str(tmp_path / "results"), checkpoint_deadline_s=600.0,
                      fix=True)
    spec_path = tmp_path / "spec.json"
    spec_path.write_text(spec.to_json())
    start = time.time()
    result = launch([str(job), "train", str(spec_path), "2"], 4, tmp_path / "train.log", timeout_s=600, grace_s=60)
    log = (tmp_path / "train.log").read_text()
    assert result.returncodes[2] == 9 and all(rc != 0 for rc in result.returncodes)
    assert result.torn_down == [], "survivors had to be killed: they did not fail on their own"
    reports = {r: json.loads((tmp_path / "results" / f"rank{r}.json").read_text()) for r in (0, 1, 3)}
    for rank, report in reports.items():
        assert report["status"] == "failed" and report["error_type"] == "CheckpointAborted", report.get("error")
        assert "rank(s) 2 left the checkpoint" in report["error"]
    killed_at = float((tmp_path / "results" / "killed_at").read_text())
    assert killed_at > start
    assert max(r["error_time_s"] for r in reports.values()) - killed_at < 30, "survivors must fail within 30 s"
    from ckptdoctor.diagnose.logs import diagnose

    diagnosis = diagnose([tmp_path / "train.log"])  # the fault test's own log, read by the diagnoser
    assert diagnosis["error_kind"] == "peer-closed" and set(diagnosis["ranks"]) <= {0, 1, 3}
    assert diagnosis["causes"][0]["cause"].startswith("another rank died")
    root = tmp_path / "checkpoints"
    assert ScalableCheckpointing.latest(root) == root / "step-1" / "accelerator"
    assert not (root / "step-2" / "accelerator").exists()
    resumed = launch([str(job), "resume", str(spec_path)], 4, tmp_path / "resume.log", timeout_s=600)
    assert resumed.returncodes == [0] * 4, (tmp_path / "resume.log").read_text()[-3000:]
    assert json.loads((tmp_path / "results" / "resume0.json").read_text())["loaded"].endswith("step-1/accelerator")


@pytest.mark.slow
def test_training_resumed_from_a_checkpoint_repeats_the_uninterrupted_losses_bit_exactly(tmp_path):
    import json
    import shutil
    from pathlib import Path

    from ckptdoctor.repro.config import TrainingConfig
    from ckptdoctor.repro.launcher import launch
    from ckptdoctor.repro.model import MovaShape
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

"""MOVA's own trainer (accelerate_train.py -> AccelerateTrainer), CPU gloo ranks under
`accelerate launch` with MOVA's fsdp_8.yaml: the reproduction through its real code and the
patch at the deadline that breaks it (8 ranks, the file's own), a rank killed or frozen mid-save,
and resume (4 ranks, see CONTEXT_PARALLEL_AT; the async case on 8) (minutes each).

On the reporter's stack only (torch 2.8.0, accelerate 1.13.0): that is the code the patch is
for, and these jobs take about a quarter of the suite's time."""

import hashlib
import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from ckptdoctor.fix.publish import (COMPLETE_MARKER, INCOMPLETE, counts_as_checkpoint, find_latest, is_complete,
                                    legacy_complete)
from ckptdoctor.repro.mova.job import PATCHED_FILES, TRAINER, MovaRun, run_mova
from ckptdoctor.repro.reproduce import FIRST_SAVE, ReproOptions, reproduce
from ckptdoctor.repro.stacks import USER, installed_versions

from support.commands import CKPTDOCTOR, SCRIPTS_REPRO, first_run, rerun, verdict_line
from support.paths import REPO
from support.reproduction import assert_rank0_planned_while_the_peers_timed_out

pytestmark = [pytest.mark.slow, pytest.mark.skipif(installed_versions() != (USER.torch, USER.accelerate),
                                                   reason="MOVA's trainer is tested on the reporter's stack")]
REPORTED_CHAIN = ["main", "train", "_save_checkpoint", "save_state", "save_fsdp_optimizer", "wrapper", "inner_func",
                  "save", "_save_state_dict", "reduce_scatter", "scatter_object", "wrapper", "scatter_object_list",
                  "wrapper", "broadcast"]
SITE_FRAME = re.compile(r'File "[^"]*site-packages/([^"]+)", line (\d+), in (\w+)')
SMALL = 2  # DiT blocks per video tower for the resume jobs (the reproduction needs its default)
# The resume jobs run fsdp_8.yaml on 4 ranks through accelerate launch's own flags, context parallel 2 x
# dp_shard 2 where the file says 4 x 2: the same 2 data-parallel shards, so the same batches and the same
# losses as on 8 ranks, in half the time on 2 cores. The async test keeps the file's 8 ranks (issue 31).
CONTEXT_PARALLEL_AT = {4: 2, 8: 4}


def why(report: dict) -> str:
    """What a failed reproduction's report says of its attempts, whole (pytest cuts dicts short)."""
    return json.dumps({k: report.get(k) for k in ("attempts", "not_separable", "margins", "calibration", "log")},
                      indent=1, default=str)


def reproduction(extract, tmp_path_factory, mode, fix=False, deadline_s=None, **options):
    out = tmp_path_factory.mktemp(f"mova-{mode}{'-fixed' if fix else ''}")
    return reproduce(ReproOptions(trainer="mova", mode=mode, output_dir=out, fix=fix, deadline_s=deadline_s,
                                  extract=str(extract.path), **options), progress=lambda _: None)


@pytest.fixture(scope="module")
def readme_repro(extract):
    """The README's first command as a newcomer runs it: `scripts/repro` from the checkout root,
    no arguments (the extract is beside the checkout, as on every machine here)."""
    return first_run(SCRIPTS_REPRO, REPO)


@pytest.fixture(scope="module")
def sft(readme_repro):
    return readme_repro[1]


@pytest.fixture(scope="module")
def readme_fix(readme_repro):
    """`ckptdoctor repro --fix` from the checkout root, no other argument: its scratch copy of MOVA
    lies inside the checkout's work tree, where `git apply` skips files and exits 0."""
    return rerun([CKPTDOCTOR, "repro", "--fix"], REPO, report="fix-report.json")


@pytest.fixture(scope="module")
def lora(extract, tmp_path_factory):
    return reproduction(extract, tmp_path_factory, "lora")


@pytest.fixture(scope="module")
def sft_fixed(readme_fix):
    return readme_fix[1]


@pytest.fixture(scope="module")
def lora_fixed(lora, extract, tmp_path_factory):
    """The minimal integration (`ckptdoctor integrate`: one call after accelerator.prepare) on LoRA;
    the README's `repro --fix` runs the full patch on SFT: each level at a deadline that broke stock.
    Saves only (--no-roundtrip): LoRA's resume through MOVA's code at level 1 is the kill-and-restart
    test below, and the README's `repro --fix` (SFT) loads back; loading back here took 1-2 min more."""
    return reproduction(extract, tmp_path_factory, "lora", fix=True, deadline_s=lora["deadline_ms"] / 1000,
                        integration="minimal", roundtrip=False)


# -- the README's commands, as a user runs them ------------------------------------------------

def test_scripts_repro_from_the_checkout_root_reproduces_on_movas_trainer(readme_repro):
    proc, report = readme_repro
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "[trainer] MOVA's own trainer" in proc.stdout
    assert verdict_line(proc).startswith("REPRODUCED: 8 ranks, MOVA trainer, mode sft, torch 2.8.0")
    assert report["trainer"] == "mova" and report["reproduced"] is True
    assert Path(report["log"]).is_relative_to(REPO / "runs" / "repro")  # the default --out, from the root


def test_repro_fix_with_default_arguments_runs_patched_mova_and_round_trips(readme_repro, readme_fix):
    proc, fixed = readme_fix
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert verdict_line(proc).startswith("FIXED: 8 ranks, MOVA trainer, mode sft")
    patched = REPO / "runs" / "repro" / "mova-patched" / TRAINER
    assert hashlib.sha256(patched.read_bytes()).hexdigest() == PATCHED_FILES[str(TRAINER)]
    assert fixed["deadline_ms"] == readme_repro[1]["deadline_ms"]  # the deadline that broke stock, reused
    assert "at which the reproduction in" in fixed["deadline_source"]
    assert fixed["fixed"] is True and fixed["roundtrip_bitexact"] is True, fixed["roundtrip_differences"]
    assert "[Resume] Loaded from " + str(Path(fixed["checkpoint_dir"]).parent.parent / "final") in \
        Path(fixed["log"]).read_text()  # the round trip went through MOVA's own _resume_checkpoint


# -- the reproduction through MOVA's own files --------------------------------------------------

def test_unpatched_sft_times_out_in_the_reported_chain_through_movas_own_files(sft):
    assert sft["reproduced"] is True, why(sft)
    assert (sft["failed_call"], sft["failed_phase"], sft["waiting_call"]) == \
        ("save_fsdp_optimizer", "plan-scatter", "broadcast")
    assert sft["model_save_ok"] is True and sft["optimizer_save_ok"] is False
    frames = sft["frames"]
    assert frames[frames.index("main", 1):] == REPORTED_CHAIN  # from accelerate_train.py's main down
    movas = [loc for loc in sft["frame_locations"] if "/mova/" in loc or "accelerate_train.py" in loc]
    assert [re.sub(r".*/(scripts|mova)/", r"\1/", loc) for loc in movas] == [
        "scripts/training_scripts/accelerate_train.py:148 in <module>",
        "scripts/training_scripts/accelerate_train.py:144 in main",
        "mova/engine/trainer/accelerate/accelerate_trainer.py:466 in train",
        "mova/engine/trainer/accelerate/accelerate_trainer.py:515 in _save_checkpoint"]
    assert re.fullmatch(r"\[[^\]]*/gloo/transport/tcp/unbound_buffer\.cc:\d+\] Timed out waiting "
                        rf"{sft['deadline_ms']}ms for recv operation to complete", sft["gloo_error"])
    assert sft["ranks_timed_out"] == list(range(1, 8))


def test_the_library_frames_equal_the_reports_line_for_line(sft, user_report_text):
    """torch's and Accelerate's frames, file and line, as in the report's first traceback
    (MOVA's own lines differ: the reporter's copy has more lines than the published branch)."""
    first_rank = user_report_text[user_report_text.index("[rank1136]: Traceback"):]
    reported = SITE_FRAME.findall(first_rank)
    ours = [SITE_FRAME.search(f'File "{loc.split(":")[0]}", line {loc.split(":")[1].split()[0]}, in {loc.split()[-1]}')
            for loc in sft["frame_locations"]]
    assert [m.groups() for m in ours if m] == reported


def test_rank0_was_planning_while_the_peers_timed_out_and_the_margin_is_reported(sft):
    assert_rank0_planned_while_the_peers_timed_out(sft)


def test_diagnose_reads_the_reproductions_own_log(sft):
    from ckptdoctor.diagnose.logs import diagnose

    report = diagnose([sft["log"]])
    assert (report["operation"], report["target"], report["phase"], report["waiting_call"]) == \
        ("save", "optimizer", "plan-scatter", "broadcast")
    assert report["ranks"] == list(range(1, 8)) and report["waiting_on"] == [0]
    assert report["timeout_ms"] == sft["deadline_ms"]
    assert (report["torch"], report["accelerate"]) == (USER.torch, USER.accelerate)


def test_unpatched_lora_times_out_in_the_model_saves_plan_scatter(lora):
    assert lora["reproduced"] is True, why(lora)
    assert (lora["failed_call"], lora["failed_phase"], lora["waiting_call"]) == \
        ("save_fsdp_model", "plan-scatter", "broadcast")
    assert "accelerate_trainer.py:515 in _save_checkpoint" in " ".join(lora["frame_locations"])


@pytest.mark.parametrize("which", ["sft", "lora"])
def test_patched_mova_saves_at_the_deadline_that_broke_it(which, request):
    stock, fixed = request.getfixturevalue(which), request.getfixturevalue(f"{which}_fixed")
    assert stock["reproduced"] is True, why(stock)
    assert fixed["deadline_ms"] == stock["deadline_ms"]
    assert fixed["gloo_error"] is None and set(fixed["rank_status"].values()) == {"ok"}
    assert fixed["save_ok"] is True and fixed["fixed"] is True
    assert fixed["roundtrip_bitexact"] is {"sft": True, "lora": None}[which]  # lora_fixed saves only
    save_path = Path(fixed["checkpoint_dir"]).parent.parent
    # the full patch publishes each step directory whole; the minimal integration, each Accelerate directory
    published, listed = {"full": ("", ["accelerator/optimizer_0", "accelerator/pytorch_model_fsdp_0"]),
                         "minimal": ("accelerator", ["optimizer_0", "pytorch_model_fsdp_0"])}[fixed["integration"]]
    assert fixed["integration"] == {"sft": "full", "lora": "minimal"}[which]
    for step in (FIRST_SAVE, "final"):  # MOVA saves at the interval and at the end
        assert is_complete(save_path / step / published), step
        marker = json.loads((save_path / step / published / COMPLETE_MARKER).read_text())
        assert sorted(marker["dcp_checkpoints"]) == listed
        assert not [p for p in (save_path / step).iterdir() if INCOMPLETE in p.name]
    assert not [p for p in save_path.iterdir() if INCOMPLETE in p.name]


# -- resume on MOVA's code ------------------------------------------------------------------------

def mova_job(copy, root, mode, max_steps, save_path=None, fault=None, ranks=4):
    run = MovaRun(mode=mode, world_size=ranks, context_parallel=CONTEXT_PARALLEL_AT[ranks], video_layers=SMALL,
                  max_steps=max_steps, save_interval=4, fault=fault)
    return run_mova(run, copy, root, deadline_s=1800.0, save_path=save_path)


def per_rank(outcome, field):
    return [r[field] for r in outcome.ranks]


@pytest.fixture(scope="module")
def straight(mova_copies, tmp_path_factory):
    """Patched MOVA, 8 steps without interruption, per mode: the losses a resume must repeat (4 ranks)."""
    root = tmp_path_factory.mktemp("straight")
    runs = {mode: mova_job(mova_copies["patched"], root / mode, mode, 8) for mode in ("sft", "lora")}
    for run in runs.values():
        assert run.returncode == 0, run.log_path.read_text()[-3000:]
    return runs


@pytest.fixture(scope="module")
def straight_8(mova_copies, tmp_path_factory):
    """The same on fsdp_8.yaml's own 8 ranks, sft: the async test's reference."""
    run = mova_job(mova_copies["patched"], tmp_path_factory.mktemp("straight-8"), "sft", 8, ranks=8)
    assert run.returncode == 0, run.log_path.read_text()[-3000:]
    assert len(run.ranks) == 8
    return run


def test_a_rank_frozen_mid_save_makes_the_others_leave_on_their_own_and_the_resume_repeats_the_losses(
        mova_copies, straight, tmp_path, monkeypatch):
    """Resumed from the straight run's step-4, rank 3 freezes (SIGSTOP: a node that vanished, its
    connections open) in step-8's optimizer save. A rank that exits would not do: torchrun tears
    every rank down itself within a second of an exit, fix or not. Frozen, nobody but the fix
    notices: without it the others wait in the plan exchange for the group's deadline (1800 s here,
    past the job's limit). With it, rank 0's heartbeat watch names rank 3 after the lost-rank window
    and the others exit 75 (torchrun stops the rest once the first has); nothing is published, and a
    restart resumes step-4."""
    from ckptdoctor.fix.heartbeat import EXIT_LOST_RANK

    monkeypatch.setenv("CKPTDOCTOR_LOST_RANK_S", "6")  # every rank reads it: the knob, as a user sets it
    save_path = tmp_path / "checkpoints"  # the job resumes the straight run's step-4, its first save is step-8's
    shutil.copytree(straight["sft"].save_path / "step-4", save_path / "step-4")
    fault = {"kind": "sigstop", "rank": 3, "save": "optimizer_0", "call": 1}
    frozen = mova_job(mova_copies["patched"], tmp_path / "frozen", "sft", 8, save_path=save_path, fault=fault)
    assert frozen.returncode != 0
    log = frozen.log_path.read_text()
    left = re.findall(rf"ckptdoctor: rank (\d+): rank\(s\) 3 stopped answering for 6 s; exiting with code "
                      rf"{EXIT_LOST_RANK} \(nothing was published\)", log)
    assert left and set(map(int, left)) <= {0, 1, 2}, log[-3000:]  # the first one out ends the job:
    assert f"(exitcode: {EXIT_LOST_RANK})" in log  # torchrun then stops the rest (the frozen one: wait_for_torchrun)
    assert frozen.save_path == save_path and "[Resume] Loaded from " + str(save_path / "step-4") in log
    assert find_latest(save_path) == save_path / "step-4"  # step-8 was never published ...
    assert not (save_path / "step-8").exists() and [p.name.startswith("step-8" + INCOMPLETE)
                                                     for p in save_path.iterdir() if "step-8" in p.name] == [True]
    resumed = mova_job(mova_copies["patched"], tmp_path / "resumed", "sft", 8, save_path=save_path)
    assert resumed.returncode == 0, resumed.log_path.read_text()[-3000:]
    assert "[Resume] Loaded from " + str(save_path / "step-4") + ", step=4" in resumed.log_path.read_text()
    assert per_rank(resumed, "losses") == [losses[4:] for losses in per_rank(straight["sft"], "losses")]
    assert per_rank(resumed, "rng_digests") == [d[4:] for d in per_rank(straight["sft"], "rng_digests")]


def test_async_a_rank_killed_in_a_background_save_leaves_step_4_and_the_restart_repeats_the_losses(
        mova_copies, straight_8, tmp_path, monkeypatch):
    """On fsdp_8.yaml's 8 ranks, the full patch with CKPTDOCTOR_ASYNC=1 (every rank reads it): step-4 is saved in the
    background and published; rank 3 dies (exit) in step-8's optimizer save, on its background
    thread, and torchrun tears the job down. Nothing of step-8 is published; the restart, async
    too, resumes step-4 through MOVA's own scan and `_resume_checkpoint`, repeats the uninterrupted
    losses, and its own saves (step-8, final) are published at the end of the process."""
    monkeypatch.setenv("CKPTDOCTOR_ASYNC", "1")
    save_path = tmp_path / "checkpoints"
    fault = {"kind": "exit", "rank": 3, "save": "optimizer_0", "call": 2}  # step-8's optimizer save
    killed = mova_job(mova_copies["patched"], tmp_path / "killed", "sft", 8, save_path=save_path, fault=fault,
                      ranks=8)
    assert killed.returncode != 0
    assert (killed.log_path.parent / "results" / "fault_thread").read_text().startswith("ckptdoctor-save")
    log = killed.log_path.read_text()
    assert log.count("in the background: training waited") == 1 and "async saves" in log  # step-4's
    assert find_latest(save_path) == save_path / "step-4" and is_complete(save_path / "step-4")
    assert not (save_path / "step-8").exists() and [p.name.startswith("step-8" + INCOMPLETE)
                                                     for p in save_path.iterdir() if "step-8" in p.name] == [True]
    resumed = mova_job(mova_copies["patched"], tmp_path / "resumed", "sft", 8, save_path=save_path, ranks=8)
    assert resumed.returncode == 0, resumed.log_path.read_text()[-3000:]
    log = resumed.log_path.read_text()
    assert "[Resume] Loaded from " + str(save_path / "step-4") + ", step=4" in log
    assert per_rank(resumed, "losses") == [losses[4:] for losses in per_rank(straight_8, "losses")]
    assert per_rank(resumed, "rng_digests") == [d[4:] for d in per_rank(straight_8, "rng_digests")]
    assert log.count("in the background: training waited") == 2  # step-8 and final, published at exit
    assert is_complete(save_path / "step-8") and is_complete(save_path / "final")
    assert not [p for p in save_path.iterdir() if INCOMPLETE in p.name]  # the next commit removed the dead one


@pytest.fixture(scope="module")
def level1_killed(mova_copies, tmp_path_factory):
    """Level 1 (install), a rank killed in step-8's optimizer save, run once per mode: the
    kill-then-restart test resumes it, and its step-4 holds LoRA adapters exported by MOVA's own
    code (get_state_dict: level 1 leaves MOVA's export as it is), the LoRA test's reference."""
    runs = {}

    def killed(mode):
        if mode not in runs:
            fault = {"kind": "exit", "rank": 3, "save": "optimizer_0", "call": 2}  # in step-8's optimizer save
            runs[mode] = mova_job(mova_copies["minimal"], tmp_path_factory.mktemp(f"level1-{mode}"), mode, 8,
                                  fault=fault)
        return runs[mode]
    return killed


@pytest.mark.parametrize("mode", ["sft", "lora"])
def test_level1_after_a_rank_killed_mid_save_a_restart_resumes_the_newest_complete_step_bit_exactly(
        mode, mova_copies, straight, level1_killed, tmp_path):
    """The minimal integration (`ckptdoctor integrate`: install after prepare, save_root read from
    MOVA's code) publishes only `step-N/accelerator`; MOVA's own scan picks the newest `step-N`.
    Without the set-aside, every restart stopped on the dead step-8 (load_state refused it)."""
    killed = level1_killed(mode)
    assert killed.returncode != 0
    save_path = killed.save_path
    dead = save_path / "step-8"  # as MOVA leaves it: its own files, then a save_state that died
    assert (dead / "trainer_state.pt").is_file() and not counts_as_checkpoint(dead / "accelerator")
    assert [p.name.startswith("accelerator" + INCOMPLETE) for p in dead.iterdir() if INCOMPLETE in p.name] == [True]
    (save_path / "step-12" / "video_dit").mkdir(parents=True)  # INJECTED: a save that died in MOVA's own weights
    resumed = mova_job(mova_copies["minimal"], tmp_path / "resumed", mode, 8, save_path=save_path)
    assert resumed.returncode == 0, resumed.log_path.read_text()[-3000:]
    log = resumed.log_path.read_text()
    assert f"[Resume] Loading checkpoint from: {save_path / 'step-4'}" in log  # MOVA's own line, its own scan
    assert log.count("set it aside as step-") == 2 and log.count("saves through ckptdoctor.install (level 1") == 4
    assert per_rank(resumed, "losses") == [losses[4:] for losses in per_rank(straight[mode], "losses")]
    assert per_rank(resumed, "rng_digests") == [d[4:] for d in per_rank(straight[mode], "rng_digests")]
    assert is_complete(save_path / "step-8" / "accelerator") and is_complete(save_path / "final" / "accelerator")
    assert not [p for p in save_path.rglob("*") if INCOMPLETE in p.name]  # the next save removed every leftover


def test_lora_resume_takes_every_piece_from_one_step_and_repeats_the_uninterrupted_losses(
        mova_copies, straight, level1_killed, tmp_path):
    save_path = tmp_path / "checkpoints"  # the patched trainer's step-4: the straight run's, as it stopped there
    step4 = save_path / "step-4"
    shutil.copytree(straight["lora"].save_path / "step-4", step4)
    assert torch.load(step4 / "trainer_state.pt")["global_step"] == 4
    # the same 4 steps exported by MOVA's own code, which gathers the whole model (get_state_dict)
    stock = level1_killed("lora").save_path / "step-4" / "lora_weights.pt"
    ours, theirs = torch.load(step4 / "lora_weights.pt"), torch.load(stock)
    assert ours.keys() == theirs.keys() and len(ours) > 0
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)  # gathered adapter by adapter, bit for bit
    resumed = mova_job(mova_copies["patched"], tmp_path / "resumed", "lora", 8, save_path=save_path)
    assert resumed.returncode == 0, resumed.log_path.read_text()[-3000:]
    assert "[Resume] Loaded from " + str(step4) + ", step=4" in resumed.log_path.read_text()
    assert per_rank(resumed, "losses") == [losses[4:] for losses in per_rank(straight["lora"], "losses")]
    assert per_rank(resumed, "rng_digests") == [d[4:] for d in per_rank(straight["lora"], "rng_digests")]


def test_a_checkpoint_of_the_unpatched_trainer_still_resumes_with_the_patch(mova_copies, straight, tmp_path):
    stock = mova_job(mova_copies["stock"], tmp_path / "stock", "sft", 4)
    assert stock.returncode == 0, stock.log_path.read_text()[-3000:]
    assert legacy_complete(stock.save_path / "step-4") and not is_complete(stock.save_path / "step-4")
    assert per_rank(stock, "losses") == [losses[:4] for losses in per_rank(straight["sft"], "losses")]
    resumed = mova_job(mova_copies["patched"], tmp_path / "resumed", "sft", 8, save_path=stock.save_path)
    assert resumed.returncode == 0, resumed.log_path.read_text()[-3000:]
    assert per_rank(resumed, "losses") == [losses[4:] for losses in per_rank(straight["sft"], "losses")]


def test_rollback_unpatched_mova_resumes_what_the_patched_trainer_saved_bit_for_bit(mova_copies, straight, tmp_path):
    """The rollback the guide describes: remove the fix, keep the checkpoints. Stock MOVA (stock
    accelerator.load_state, its own directory scan) resumes step-4 of the patched run and repeats
    the uninterrupted run's losses and RNG states exactly."""
    save_path = tmp_path / "checkpoints"
    shutil.copytree(straight["sft"].save_path / "step-4", save_path / "step-4")  # the patched trainer's step
    assert is_complete(save_path / "step-4") and list(save_path.glob("step-4/accelerator/*/.ckptdoctor-index"))
    resumed = mova_job(mova_copies["stock"], tmp_path / "resumed", "sft", 8, save_path=save_path)
    assert resumed.returncode == 0, resumed.log_path.read_text()[-3000:]
    assert "[Resume] Loaded from " + str(save_path / "step-4") + ", step=4" in resumed.log_path.read_text()
    assert per_rank(resumed, "losses") == [losses[4:] for losses in per_rank(straight["sft"], "losses")]
    assert per_rank(resumed, "rng_digests") == [d[4:] for d in per_rank(straight["sft"], "rng_digests")]

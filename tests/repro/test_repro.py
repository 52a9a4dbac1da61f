"""The reproduction itself: real 8-rank jobs through Accelerate's save_state (minutes each)."""

import re
from pathlib import Path

import pytest

from ckptdoctor.repro.mova.job import EXTRACT_ENV, Extract, ExtractProblem
from ckptdoctor.repro.stacks import USER, installed_versions

from support.commands import CKPTDOCTOR, first_run, rerun, verdict_line
from support.reproduction import assert_rank0_planned_while_the_peers_timed_out


def movas_trainer_covers_this_stack() -> bool:
    """On the reporter's stack, with MOVA's extract here, tests/mova runs the same reproduction and
    fix through MOVA's own trainer with these assertions; the look-alike then runs on the newest
    stack only (each reproduction is minutes of CI)."""
    if installed_versions() != (USER.torch, USER.accelerate):
        return False
    try:
        Extract.find()
    except ExtractProblem:
        return False
    return True


# On the reporter's stack with MOVA's extract (as in CI), tests/mova covers what this module would: the
# frames line for line against the report, LoRA's model save tripping first, and the fix at LoRA's deadline.
pytestmark = [pytest.mark.slow, pytest.mark.skipif(movas_trainer_covers_this_stack(), reason=
                                                   "the reproduction runs through MOVA's own trainer on this stack")]


@pytest.fixture(scope="module")
def elsewhere(tmp_path_factory):
    """A working directory outside the checkout, and no MOVA extract to be found: as for a user
    who installed ckptdoctor without MOVA's code beside it."""
    return tmp_path_factory.mktemp("cwd"), {EXTRACT_ENV: str(tmp_path_factory.mktemp("no-extract") / "mova")}


@pytest.fixture(scope="module")
def readme_repro(elsewhere):
    """`ckptdoctor repro` with no argument, run from another directory (default --out runs/repro)."""
    cwd, env = elsewhere
    return first_run([CKPTDOCTOR, "repro"], cwd, env=env)


@pytest.fixture(scope="module")
def sft(readme_repro):
    return readme_repro[1]


def test_sft_optimizer_save_times_out_in_the_plan_scatter_after_the_model_save_completed(sft):
    assert sft["reproduced"] is True
    assert sft["model_save_ok"] is True and sft["optimizer_save_ok"] is False
    assert (sft["failed_call"], sft["failed_phase"], sft["waiting_call"]) == ("save_fsdp_optimizer", "plan-scatter", "broadcast")
    assert sft["ranks_timed_out"] == list(range(1, 8))
    assert re.fullmatch(r"\[[^\]]*/gloo/transport/tcp/unbound_buffer\.cc:\d+\] Timed out waiting (\d+)ms for recv "
                        r"operation to complete", sft["gloo_error"])
    waited_ms = int(re.search(r"waiting (\d+)ms", sft["gloo_error"]).group(1))
    assert abs(waited_ms - sft["deadline_ms"]) <= 1


def test_sft_frames_are_the_reported_chain(sft):
    frames = sft["frames"]
    chain = frames[frames.index("save_state"):]
    assert chain == ["save_state", "save_fsdp_optimizer", "wrapper", "inner_func", "save", "_save_state_dict",
                     "reduce_scatter", "scatter_object", "wrapper", "scatter_object_list", "wrapper", "broadcast"]


def test_sft_rank0_was_planning_while_the_peers_timed_out(sft):
    assert_rank0_planned_while_the_peers_timed_out(sft)


# -- the fix, at the very deadline that made stock time out ------------------------------

@pytest.fixture(scope="module")
def readme_fix(readme_repro, elsewhere):
    cwd, env = elsewhere
    return rerun([CKPTDOCTOR, "repro", "--fix"], cwd, env=env, report="fix-report.json")


@pytest.fixture(scope="module")
def sft_fixed(readme_fix):
    return readme_fix[1]


def test_ckptdoctor_repro_from_another_directory_takes_the_look_alike_and_reproduces(readme_repro, elsewhere):
    proc, report = readme_repro
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "[trainer] the look-alike trainer: MOVA's own is not available (no MOVA extract at" in proc.stdout
    assert verdict_line(proc).startswith("REPRODUCED: 8 ranks, look-alike trainer, mode sft")
    assert report["trainer"] == "lookalike" and report["reproduced"] is True
    assert Path(report["log"]).is_relative_to(elsewhere[0] / "runs" / "repro")  # relative to where it ran


def test_ckptdoctor_repro_fix_from_another_directory_reuses_the_breaking_deadline(readme_repro, readme_fix):
    proc, report = readme_fix
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert verdict_line(proc).startswith("FIXED: 8 ranks, look-alike trainer, mode sft")
    assert report["deadline_ms"] == readme_repro[1]["deadline_ms"] and "at which the reproduction in" in \
        report["deadline_source"]
    assert report["fixed"] is True and report["roundtrip_bitexact"] is True


def test_the_fix_completes_at_the_stock_deadline_and_round_trips_bit_exactly(sft, sft_fixed):
    stock, report = sft, sft_fixed
    assert stock["reproduced"] is True  # the same deadline made stock fail
    assert report["deadline_ms"] == stock["deadline_ms"]
    assert report["gloo_error"] is None and set(report["rank_status"].values()) == {"ok"}
    assert report["save_ok"] is True and report["model_save_ok"] and report["optimizer_save_ok"]
    assert report["roundtrip_bitexact"] is True, report["roundtrip_differences"]


def test_diagnose_reads_the_reproductions_own_log(sft):
    from ckptdoctor.diagnose.logs import diagnose

    report = diagnose([sft["log"]])
    assert (report["operation"], report["target"], report["phase"], report["waiting_call"]) == \
        ("save", "optimizer", "plan-scatter", "broadcast")
    assert report["ranks"] == list(range(1, 8)) and report["waiting_on"] == [0]
    assert report["timeout_ms"] == int(re.search(r"waiting (\d+)ms", sft["gloo_error"]).group(1))
    assert (report["torch"], report["accelerate"]) == installed_versions()

"""`ckptdoctor simulate`, `check` and `diagnose` as the README has a user run them: the installed
console script, relative paths, once from the checkout root and once from another directory.
Each asserts the verdict, the exit status and what landed where the relative path points.

`diagnose` and `simulate` run on the reporter's stack only (the path handling is the same on
both); `check` runs once per stack, for that stack's torch: 2.8.0 from the checkout root, named,
the newest stack's (2.15.0) from elsewhere with no --torch (the torch installed with the interpreter,
as in an image). (`check` starts the measured stack's own environment, and scripts/test sets up
the newest stack only after the reporter's stack's tests ran.)"""

import json
import shutil

import pytest

from ckptdoctor.check.units import fmt_b
from ckptdoctor.repro.stacks import NEWEST, USER, installed_versions

from support.commands import CKPTDOCTOR, run
from support.paths import EVIDENCE, REPO

on_the_users_stack_only = pytest.mark.skipif(installed_versions() != (USER.torch, USER.accelerate),
                                             reason="run once per suite, on the reporter's stack")


@pytest.fixture(params=["checkout-root", "elsewhere"])
def cwd(request, tmp_path):
    """The directory the command runs in, and the relative directory its outputs go to."""
    if request.param == "checkout-root":
        out = REPO / "runs" / "acceptance" / request.node.name
        shutil.rmtree(out, ignore_errors=True)
        yield REPO, out.relative_to(REPO)
        shutil.rmtree(out, ignore_errors=True)
    else:
        yield tmp_path, tmp_path.joinpath("out").relative_to(tmp_path)


@on_the_users_stack_only
def test_diagnose_reads_a_relative_log_and_writes_a_relative_json(cwd):
    where, out = cwd
    (where / out).mkdir(parents=True)
    shutil.copy(EVIDENCE, where / out / "report.log")
    proc = run([CKPTDOCTOR, "diagnose", str(out / "report.log"), "--json", str(out / "verdict.json")], where)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("failure: gloo-timeout during save optimizer (plan-scatter, waiting in broadcast)")
    verdict = json.loads((where / out / "verdict.json").read_text())
    assert verdict["timeout_ms"]["value"] == 1800000
    assert verdict["waiting_call"]["value"] == "broadcast" and verdict["phase"]["value"] == "plan-scatter"


@on_the_users_stack_only
def test_simulate_writes_its_table_json_and_plot_where_the_relative_paths_say(cwd):
    where, out = cwd
    proc = run([CKPTDOCTOR, "simulate", "--ranks", "8", "--layout", "fsdp", "--stack", "user", "--planner", "ours",
                "--mode", "lora", "--max-measured", "8", "--json", str(out / "sim.json"), "--plot",
                str(out / "sim.png")], where)
    assert proc.returncode == 0, proc.stderr
    records = json.loads((where / out / "sim.json").read_text())
    assert sorted((r["planner"], r["save"], r["ranks"], r["measured"]) for r in records) == \
        [("ours", "model", 8, True), ("ours", "optimizer", 8, True)]
    assert (where / out / "sim.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"plot: {out / 'sim.png'}" in proc.stdout


@pytest.mark.slow
@pytest.mark.parametrize("cwd,torch_version", [("checkout-root", USER.torch), ("elsewhere", NEWEST.torch)],
                         indirect=["cwd"])
def test_check_warns_names_the_fix_and_writes_a_relative_json(cwd, torch_version):
    if installed_versions()[0] != torch_version:
        pytest.skip(f"torch {torch_version}'s case runs on its own stack")
    where, out = cwd
    # from the checkout root the stack is named; elsewhere no --torch: the torch installed here, as in an image
    named = ["--torch", torch_version] if where == REPO else []
    proc = run([CKPTDOCTOR, "check", "--ranks", "16", "--layout", "hsdp:8", "--mode", "lora", *named,
                "--deadline", "1", "--warn-fraction", "0.1", "--async", "--json", str(out / "check.json")], where)
    assert proc.returncode == 3, proc.stderr
    result = json.loads((where / out / "check.json").read_text())
    assert result["torch"] == torch_version
    # --async: rank 0's host copy at 16 ranks, sharded over 8; a node of 8 ranks needs far more than this host has
    copy = result["host_copy"]
    assert copy["per_rank_bytes"] == sum(s["total"] for s in copy["saves"]) and copy["ranks_per_node"] == 8
    assert copy["per_node_bytes"] == 8 * copy["per_rank_bytes"] > copy["free_bytes"]
    assert any(w.startswith("async save: a node of 8 rank(s) needs ") for w in result["warnings"])
    assert f"per node of 8 rank(s) {fmt_b(copy['per_node_bytes'], 3)}; this host has" in proc.stdout
    assert {(r["planner"], r["save"]) for r in result["records"]} == {(p, s) for p in ("stock", "ours")
                                                                       for s in ("model", "optimizer")}
    assert any("optimizer save" in w and "ScalableSavePlanner" in w for w in result["warnings"])
    assert [line for line in proc.stdout.splitlines() if line.startswith("WARNING:")] == \
        [f"WARNING: {w}" for w in result["warnings"]]
    stock = {r["save"]: r["coordinator_s"] for r in result["records"] if r["planner"] == "stock"}
    ours = {r["save"]: r["coordinator_s"] for r in result["records"] if r["planner"] == "ours"}
    assert ours["optimizer"] < stock["optimizer"]

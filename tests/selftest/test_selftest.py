"""`ckptdoctor selftest`, run as a user runs it on the cluster: under torchrun or accelerate
launch, from their own directory, on CPU/gloo here (the checks that matter on NPU are the same
code; only the backend string and device differ)."""

import json
import os
import re
import subprocess
import sys

import pytest
import torch

from ckptdoctor.fix.compat import installed_versions
from ckptdoctor.selftest.checks import Check, directory, merge, mtime_granularity, open_files, store_capacity
from ckptdoctor.selftest.roundtrip import visible

from support.faults import coarse_timestamps, read_only_bind, small_tmpfs
from support.paths import REPO

CHECKS = ["directory", "directory fsync", "open files", "store load", "model", "checkpoint group", "save (fix)",
          "visible on every rank", "load (fix)", "load (stock)", "free space", "mtime granularity"]


def torchrun(ranks, cwd, *args, timeout=600):
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks),
                           "-m", "ckptdoctor", "selftest", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "OMP_NUM_THREADS": "1"})


def verdicts(report) -> dict:
    return {c["name"]: c["verdict"] for c in report["checks"]}


@pytest.mark.slow
def test_two_ranks_under_torchrun_from_the_users_directory_pass_every_check(tmp_path):
    """The documented command with a relative --dir, run from a directory that is not the checkout."""
    proc = torchrun(2, tmp_path, "--dir", "shared/selftest", "--json", "report.json")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["world_size"] == 2 and report["backend"] == "gloo" and report["device"] == "cpu"
    assert verdicts(report) == dict.fromkeys(CHECKS, "PASS"), verdicts(report)
    assert report["dir"].startswith(str(tmp_path / "shared" / "selftest"))  # relative to where it ran
    assert not any((tmp_path / "shared" / "selftest").iterdir())  # the test's checkpoint is removed after
    loads = [c for c in report["checks"] if c["name"].startswith("load")]
    assert all("equal the saved ones" in c["detail"] for c in loads)
    save = next(c for c in report["checks"] if c["name"] == "save (fix)")
    assert "save_state" in save["values"]["phases_s"]
    format_here = "torch 2.15 or newer" if tuple(map(int, installed_versions()[0].split(".")[:2])) >= (2, 15) \
        else "torch 2.14 or older"
    assert save["values"]["format"].startswith(f"written by {format_here}") and save["values"]["format"] in save["detail"]
    assert "RESULT: PASS, every check passed" in proc.stdout


@pytest.mark.slow
def test_async_the_save_returns_with_a_host_copy_and_what_is_published_is_the_copy_not_the_zeroed_shards(tmp_path):
    """`selftest --async`: the shards are zeroed as soon as save_state returns, while the background
    writes; both loads must bring the saved checksums back."""
    from ckptdoctor.check.host_copy_model import host_copies
    from ckptdoctor.check.jobs import Workload
    from ckptdoctor.check.layout import Layout
    from ckptdoctor.check.state_dicts import find_checkpoints

    proc = torchrun(2, tmp_path, "--dir", "st", "--async", "--json", "report.json", "--keep")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "report.json").read_text())
    assert verdicts(report) == dict.fromkeys(CHECKS, "PASS"), verdicts(report)
    save = next(c for c in report["checks"] if c["name"] == "save (fix)")
    # rank 0's copy: its half of the parameters and of AdamW's two moments, in fp32 ...
    copied = save["values"]["host_copy_bytes"]
    assert copied == pytest.approx(12 * report["parameters"] / 2, rel=0.02)
    # ... byte for byte what `check --async`'s model counts from the checkpoint it wrote, at 2 ranks
    written = next(tmp_path.glob("st/**/optimizer_0/.metadata")).parent.parent
    checkpoints = {name: str(path) for name, path in find_checkpoints(written)}
    workload = Workload(ranks=[2], layouts=[Layout.parse("fsdp")], saves=tuple(checkpoints), checkpoints=checkpoints)
    assert sum(c.total for c in host_copies(workload, Layout.parse("fsdp"), 2)) == copied
    assert save["detail"].startswith("training waited ") and "while the shards were zeroed" in save["detail"]
    assert "save_state (background)" in save["values"]["phases_s"]


@pytest.mark.slow
def test_a_full_file_system_fails_the_save_on_every_rank_with_one_reason_and_every_rank_exits_1(tmp_path):
    """Real fault: a 30 MB tmpfs for a checkpoint of about 43 MB."""
    from ckptdoctor.repro.launcher import launch

    with small_tmpfs(tmp_path / "full", "30m") as full:
        result = launch(["-m", "ckptdoctor", "selftest", "--dir", str(full), "--json", str(tmp_path / "r.json")], 2,
                        tmp_path / "job.log", timeout_s=300)
        left = list(full.iterdir())
    assert result.returncodes == [1, 1] and result.torn_down == [], (tmp_path / "job.log").read_text()[-3000:]
    report = json.loads((tmp_path / "r.json").read_text())
    checks = {c["name"]: c for c in report["checks"]}
    assert checks["free space"]["verdict"] == "FAIL" and "MB free" in checks["free space"]["detail"]
    assert checks["save (fix)"]["verdict"] == "FAIL"
    save = checks["save (fix)"]["detail"]
    # both ranks abort the save with one reason. Which ranks' writes fail in DCP is a race on the
    # shared tmpfs (one rank's file can land whole before the other's fills it): one or both. Torch's
    # writer says ENOSPC, or, when the zip writer's short write hits first, "unexpected pos".
    assert re.match(r"rank 0: CheckpointAborted: checkpoint aborted at 'save_state': rank\(s\) 0-1: in DCP on "
                    r"rank\(s\) (0|1|0-1): ", save) and save.endswith("(and 1 more rank(s))"), save
    assert "No space left on device" in save or "unexpected pos" in save, save
    assert [checks[n]["verdict"] for n in ("visible on every rank", "load (fix)", "load (stock)")] == ["SKIP"] * 3
    assert left == []  # nothing half-written is left behind
    assert "RESULT: FAIL: 2 failed (save (fix), free space), 3 skipped because of it" in \
        (tmp_path / "job.log").read_text()


@pytest.mark.slow
@pytest.mark.skipif(torch.__version__.split("+")[0] != "2.8.0", reason="on the user's stack only: the launcher, not torch")
def test_selftest_under_accelerate_launch_with_the_jobs_yaml_passes_and_check_predicts_its_checkpoint(tmp_path):
    """As the guide says to launch it: with the job's own yaml. With MOVA's extract here, that is
    MOVA's fsdp_8.yaml (8 ranks, FSDP2 with offload, and its parallelism_config: cp 4 x dp_shard 2,
    which Accelerate reads beside the selftest's own plugin); without it, 2 ranks with --multi_gpu.
    Then `check --from-checkpoint`, with a relative path, on the Accelerate directory those real
    FSDP2 processes wrote: one save per DCP checkpoint in it, every rank's items counted."""
    from torch.distributed.checkpoint import FileSystemReader

    from ckptdoctor.repro.mova.job import Extract, ExtractProblem

    try:
        launch, world = ["--config_file", str(Extract.find().path / "configs/training/accelerate/fsdp_8.yaml")], 8
    except ExtractProblem:
        launch, world = ["--multi_gpu", "--num_processes", "2"], 2
    accelerate = os.path.join(os.path.dirname(sys.executable), "accelerate")
    proc = subprocess.run([accelerate, "launch", *launch, "-m", "ckptdoctor", "selftest",
                           "--dir", "ckpt", "--json", "r.json", "--keep"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["world_size"] == world and set(verdicts(report).values()) == {"PASS"}

    written = next(tmp_path.glob("ckpt/**/optimizer_0/.metadata")).parent.parent.relative_to(tmp_path)
    proc = subprocess.run([sys.executable, "-m", "ckptdoctor", "check", "--ranks", "16", "--from-checkpoint",
                           str(written), "--deadline", "1e-6", "--json", "check.json"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 3, proc.stdout[-3000:] + proc.stderr[-3000:]  # any stock save exceeds 1 us
    result = json.loads((tmp_path / "check.json").read_text())
    saves = {r["save"]: r for r in result["records"] if r["planner"] == "stock"}
    assert sorted(saves) == ["optimizer_0", "pytorch_model_fsdp_0"]
    for name, record in saves.items():
        entries = FileSystemReader(str(tmp_path / written / name)).read_metadata().state_dict_metadata
        assert record["measured"] and record["items_gathered"] == 16 * len(entries)  # one item per entry per rank
    assert result["mode"] == "checkpoint" and len(result["warnings"]) == 2


def test_the_open_file_limit_is_checked_against_the_real_jobs_ranks():
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert open_files(2).ok
    too_many = open_files(soft)  # 2 x (N - 1) + 1024 sockets and files needed: more than the limit
    assert too_many.ok is False and f"ulimit -n is {soft}" in too_many.detail


def test_mtime_granularity_reports_whole_seconds_on_a_file_system_that_keeps_them(tmp_path):
    """Real fault: ext4 with 128-byte inodes on a loop device."""
    with coarse_timestamps(tmp_path / "coarse") as coarse:
        check = mtime_granularity(coarse)
    assert check.ok and check.values["granularity_ns"] == 1_000_000_000, check
    fine = mtime_granularity(tmp_path)
    assert fine.values["granularity_ns"] < 1_000_000_000, fine


def test_merging_names_the_first_failing_rank_and_keeps_the_slowest_time():
    ranks = [Check("save", True, 1.0, "ok"), Check("save", False, 0.5, "ENOSPC"), Check("save", False, 2.0, "ENOSPC")]
    merged = merge(ranks)
    assert (merged.ok, merged.seconds, merged.detail) == (False, 2.0, "rank 1: ENOSPC (and 1 more rank(s))")
    assert merged.values["failed_ranks"] == [1, 2]
    assert merge([Check("x", None, 0.0, "skipped")] * 2).ok is None


def test_bad_input_is_refused_in_one_line():
    proc = subprocess.run([sys.executable, "-m", "ckptdoctor", "selftest", "--dir", "x", "--width", "255"],
                          capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "ckptdoctor: error: --width must be even (the audio tower is half as wide), got 255"]


def test_a_directory_one_rank_cannot_write_fails_the_check_naming_that_rank(tmp_path):
    """Real fault: rank 1's directory is a read-only bind mount (as a host whose mount went read-only)."""
    with read_only_bind(tmp_path / "ro") as read_only:
        merged = merge([directory(tmp_path / "rw", 0), directory(read_only, 1)])
    assert merged.ok is False and merged.values["failed_ranks"] == [1]
    assert merged.detail.startswith("rank 1: OSError: [Errno 30] Read-only file system")


def test_a_step_that_never_becomes_complete_fails_visibility_after_the_wait(tmp_path):
    (tmp_path / "step-1").mkdir()  # made, never published (no marker): as a host with a stale view sees it
    check = visible(tmp_path / "step-1", wait_s=0.5)
    assert check.ok is False and check.detail == f"{tmp_path / 'step-1'} not complete on this rank after 0 s"


def test_a_store_too_slow_for_the_jobs_heartbeats_fails_naming_both_rates():
    import datetime

    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=30))  # a real store
    check = store_capacity(store, rank=0, world_size=1, job_ranks=10**9, requests=20)  # heartbeats of 10^9 ranks
    assert check.ok is False and "requests/s here; heartbeats at 1000000000 ranks need" in check.detail
    assert store_capacity(store, rank=0, world_size=1, job_ranks=8, requests=20).ok is True

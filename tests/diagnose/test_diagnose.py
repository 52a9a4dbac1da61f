"""`ckptdoctor diagnose` on the user's report and on logs shaped like the failures it must tell apart
(real third-party logs: test_real_logs.py)."""

import gzip
import json
import subprocess
import sys
import tracemalloc

import pytest

from ckptdoctor.diagnose.logs import diagnose
from ckptdoctor.diagnose.scan import BLOCK, scan

SP = "/usr/local/lib/python3.11/site-packages"
SAVE_OPTIM_28 = [
    ("/job/train.py", 160, "<module>"), ("/job/train.py", 156, "main"),
    (f"{SP}/accelerate/accelerator.py", 3662, "save_state"),
    (f"{SP}/accelerate/utils/fsdp_utils.py", 273, "save_fsdp_optimizer"),
    (f"{SP}/torch/distributed/checkpoint/logger.py", 87, "wrapper"),
    (f"{SP}/torch/distributed/checkpoint/utils.py", 475, "inner_func"),
    (f"{SP}/torch/distributed/checkpoint/state_dict_saver.py", 176, "save"),
    (f"{SP}/torch/distributed/checkpoint/state_dict_saver.py", 362, "_save_state_dict"),
    (f"{SP}/torch/distributed/checkpoint/utils.py", 217, "reduce_scatter"),
    (f"{SP}/torch/distributed/checkpoint/utils.py", 162, "scatter_object"),
    (f"{SP}/torch/distributed/distributed_c10d.py", 3762, "scatter_object_list"),
    (f"{SP}/torch/distributed/distributed_c10d.py", 2830, "broadcast"),
]
LOAD_MODEL = [
    ("/job/train.py", 10, "main"), (f"{SP}/accelerate/accelerator.py", 3791, "load_state"),
    (f"{SP}/accelerate/utils/fsdp_utils.py", 221, "load_fsdp_model"),
    (f"{SP}/torch/distributed/checkpoint/state_dict_loader.py", 1, "load"),
    (f"{SP}/torch/distributed/checkpoint/state_dict_loader.py", 2, "_load_state_dict"),
    (f"{SP}/torch/distributed/checkpoint/utils.py", 3, "reduce_scatter"),
    (f"{SP}/torch/distributed/checkpoint/utils.py", 4, "gather_object"),
    (f"{SP}/torch/distributed/distributed_c10d.py", 5, "gather_object"),
    (f"{SP}/torch/distributed/distributed_c10d.py", 6, "gather"),
]
FINISH = SAVE_OPTIM_28[:8] + [(f"{SP}/torch/distributed/checkpoint/utils.py", 1, "all_reduce"),
                              (f"{SP}/torch/distributed/checkpoint/utils.py", 2, "gather_object"),
                              (f"{SP}/torch/distributed/distributed_c10d.py", 3, "gather")]
GLOO = "RuntimeError: [/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] " \
       "Timed out waiting {ms}ms for recv operation to complete"


def traceback_lines(rank, frames, error):
    lines = [f"[rank{rank}]: Traceback (most recent call last):"]
    for file, line, func in frames:
        lines += [f'[rank{rank}]:   File "{file}", line {line}, in {func}', f"[rank{rank}]:     code()"]
    return lines + [f"[rank{rank}]: {error}"]


def interleave(*blocks):
    out = []
    for rows in zip(*blocks):
        out += rows
    return out


def write(tmp_path, name, lines, collapse=False, gz=False):
    text = (" ".join(lines) if collapse else "\n".join(lines)) + "\n"
    path = tmp_path / name
    if gz:
        with gzip.open(path, "wt") as f:
            f.write(text)
    else:
        path.write_text(text)
    return path


def test_the_users_report(user_report_text, tmp_path):
    report = diagnose([write(tmp_path, "report.txt", [user_report_text])])
    assert (report["error"], report["operation"], report["target"], report["phase"], report["waiting_call"]) == \
        ("gloo-timeout", "save", "optimizer", "plan-scatter", "broadcast")
    assert report["ranks"] == [1136, 1139]
    assert report["nodes"] is None  # the report has no host lines: no node is named
    assert report["waiting_on"] == [0] and report.finding("waiting_on").confidence == "likely"
    assert report["timeout_ms"] == 1_800_000 and report.finding("timeout_ms").confidence == "certain"
    assert (report["torch"], report["accelerate"]) == ("2.8.0", "1.13.0")
    assert report["causes"][0]["cause"].startswith("rank 0 (the DCP coordinator) was still planning")
    assert diagnose([tmp_path / "report.txt"], ranks_per_node=8)["nodes"] == {"node 142": [1136, 1139]}


def test_every_frame_of_the_users_report_is_read_in_order(user_report_text, tmp_path):
    """The report is one long line; a frame cut by one anchor's window was once skipped by the next
    (`state_dict_saver.py:362 in _save_state_dict` was missing between save and reduce_scatter)."""
    import re

    first = user_report_text[user_report_text.index("[rank1136]: Traceback"):]
    first = first[:first.index("Error", first.index("broadcast"))]
    written = [f"{file}:{line} in {func}" for file, line, func in
               re.findall(r'File "([^"]+)", line (\d+), in ([\w<>]+)', first)]
    report = diagnose([write(tmp_path, "report.txt", [user_report_text])])
    assert len(written) == 16 and report["frames"] == written


@pytest.mark.parametrize("collapse,gz", [(False, False), (True, False), (False, True)])
def test_interleaved_collapsed_or_gzip_logs_read_the_same(tmp_path, collapse, gz):
    blocks = [traceback_lines(r, SAVE_OPTIM_28, GLOO.format(ms=600000)) for r in (9, 10, 17)]
    path = write(tmp_path, "log", ["训练开始 step 200"] + interleave(*blocks) + ["保存失败"], collapse, gz)
    report = diagnose([path])
    assert report["ranks"] == [9, 10, 17] and report["nodes"] is None
    assert (report["target"], report["phase"], report["timeout_ms"]) == ("optimizer", "plan-scatter", 600000)


@pytest.mark.parametrize("frames,operation,target,phase,waiting", [
    (LOAD_MODEL, "load", "model", "plan-gather", "gather"),
    (FINISH, "save", "optimizer", "finish-gather", "gather"),
])
def test_load_and_finish_timeouts(tmp_path, frames, operation, target, phase, waiting):
    report = diagnose([write(tmp_path, "log", traceback_lines(3, frames, GLOO.format(ms=1800000)))])
    assert (report["operation"], report["target"], report["phase"], report["waiting_call"]) == \
        (operation, target, phase, waiting)
    assert report["waiting_on"] == [0]


def test_a_rank_that_died_closes_the_peers_connections(tmp_path):
    error = "RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [10.0.0.3]:2"
    log = interleave(*[traceback_lines(r, SAVE_OPTIM_28, error) for r in (1, 2)])
    report = diagnose([write(tmp_path, "log", log)])
    assert report["error"] == "peer-closed" and report["ranks"] == [1, 2]
    assert report["causes"][0]["cause"].startswith("another rank died")


def test_nccl_or_hccl_watchdog(tmp_path):
    line = ("[rank5]:[E1203 10:00:00 ProcessGroupNCCL.cpp:632] [Rank 5] Watchdog caught collective operation timeout: "
            "WorkNCCL(SeqNum=88, OpType=ALLREDUCE, Timeout(ms)=600000) ran for 600012 milliseconds before timing out.")
    report = diagnose([write(tmp_path, "log", [line])])
    assert report["error"] == "collective-watchdog" and report["timeout_ms"] == 600000 and report["ranks"] == [5]
    assert report["collectives"] == {"5": (88, "ALLREDUCE")} and report["waiting_on"] is None
    proc = subprocess.run([sys.executable, "-m", "ckptdoctor.cli", "diagnose", str(tmp_path / "log")],
                          capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout.startswith("failure: collective-watchdog")  # the text agrees


def test_a_kill_is_a_kill_and_oom_only_when_the_log_says_so(tmp_path):
    lines = ["torch.distributed.elastic.multiprocessing.errors.ChildFailedError:", "Root Cause (first observed failure):",
             "  rank      : 0 (local_rank: 0)", "  exitcode  : -9 (pid: 4242)", "  error_file: <N/A>",
             "  traceback : Signal 9 (SIGKILL) received by PID 4242"]
    report = diagnose([write(tmp_path, "log", lines)])
    assert report["error"] == "killed" and report["ranks"] == [0] and report["exitcodes"] == [-9]
    assert [(c["id"], c["confidence"]) for c in report["causes"]] == [("killed", "likely")]
    oom = diagnose([write(tmp_path, "oom", ["[rank3]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate"])])
    assert oom["error"] == "out-of-memory" and oom["ranks"] == [3] and oom["causes"][0]["confidence"] == "certain"


def test_a_log_without_an_error_claims_nothing(tmp_path):
    report = diagnose([write(tmp_path, "log", ["[rank0]: step 1 loss 2.3", "[rank1]: step 1 loss 2.4"])])
    assert report["known"] is False and report["causes"] == []
    assert all(report[name] is None for name in ("error", "ranks", "waiting_on", "timeout_ms", "nodes", "torch"))


def test_an_unknown_pattern_says_so_and_shows_its_frames(tmp_path):
    lines = traceback_lines(2, SAVE_OPTIM_28[:3], "still running")[:-1]  # frames, no error line
    report = diagnose([write(tmp_path, "log", lines)])
    assert report["known"] is False and report["error"] is None
    assert [f.split(" in ")[-1] for f in report["frames"]] == ["<module>", "main", "save_state"]
    proc = subprocess.run([sys.executable, "-m", "ckptdoctor.cli", "diagnose", str(tmp_path / "log")],
                          capture_output=True, text=True)
    assert proc.returncode == 1 and "unknown failure pattern" in proc.stdout and "save_state" in proc.stdout
    other = diagnose([write(tmp_path, "other", traceback_lines(2, SAVE_OPTIM_28[:3], "ValueError: something else"))])
    assert (other["error"], other["ranks"], [c["id"] for c in other["causes"]]) == ("python-exception", [2], ["exception"])


def test_a_large_gzip_log_is_streamed(tmp_path):
    path = tmp_path / "big.log.gz"
    noise = "[rank{}]: step 100 loss 0.1234 lr 1e-4 " + "x" * 200 + "\n"
    with gzip.open(path, "wt") as f:
        for i in range(200_000):  # ~50 MB uncompressed
            f.write(noise.format(i % 1144))
        f.write("\n".join(traceback_lines(7, SAVE_OPTIM_28, GLOO.format(ms=1800000))) + "\n")
    tracemalloc.start()
    report = diagnose([path])
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert report["ranks"] == [7] and report["phase"] == "plan-scatter"
    assert peak < 20_000_000, f"diagnose held {peak} bytes: it must stream"


def test_a_collapsed_line_is_attributed_rank_by_rank(tmp_path):
    line = "pre [rank1]: RuntimeError: boom one [rank22]: ValueError: boom two"
    evidence = scan([write(tmp_path, "log", [line])])
    assert [(s.rank, s.data["exc"]) for s in evidence.of("exception")] == [(1, "RuntimeError"), (22, "ValueError")]


def test_a_truncated_gzip_is_read_up_to_the_break_and_said(tmp_path, user_report_text):
    path = tmp_path / "log.gz"
    noise = "".join(f"[rank0]: step {i} loss {(i * 7919) % 10007 / 10007:.6f}\n" for i in range(50_000))
    with gzip.open(path, "wt") as f:
        f.write(user_report_text + "\n" + noise)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])  # cut in the middle of the noise, after the report
    report = diagnose([path])
    assert report["error"] == "gloo-timeout" and report["ranks"] == [1136, 1139]
    assert len(report.truncated) == 1 and str(path) in report.truncated[0]
    proc = subprocess.run([sys.executable, "-m", "ckptdoctor.cli", "diagnose", str(path)], capture_output=True, text=True)
    assert proc.returncode == 0 and "truncated input" in proc.stdout and "Traceback" not in proc.stderr


def test_a_directory_of_logs_is_read_file_by_file(tmp_path, user_report_text):
    (tmp_path / "run" / "attempt_0").mkdir(parents=True)
    write(tmp_path / "run" / "attempt_0", "0.log", [user_report_text])
    write(tmp_path / "run", "notes.log", ["nothing here"])
    report = diagnose([tmp_path / "run"])
    assert report["error"] == "gloo-timeout" and len(report.files) == 2


def test_cli_json_and_missing_file(tmp_path, user_report_text):
    log = write(tmp_path, "r.txt", [user_report_text])
    out = tmp_path / "d.json"
    proc = subprocess.run([sys.executable, "-m", "ckptdoctor.cli", "diagnose", str(log), "--json", str(out)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(out.read_text())
    assert {"error", "operation", "target", "phase", "waiting_call", "ranks", "waiting_on", "timeout_ms", "torch",
            "accelerate", "causes", "known"} <= set(data)
    evidence = list(diagnose([log]).finding("waiting_on").evidence)  # the library's own, in this process
    assert data["waiting_on"] == {"value": [0], "confidence": "likely", "evidence": evidence}
    assert any("2 rank(s) timed out in plan-scatter" in line for line in evidence), evidence
    assert data["error"]["value"] == "gloo-timeout" and data["known"] is True
    proc = subprocess.run([sys.executable, "-m", "ckptdoctor.cli", "diagnose", str(tmp_path / "nope.log")],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "no such log file" in proc.stderr and "Traceback" not in proc.stderr


def test_a_concatenated_gzip_is_read_member_by_member(tmp_path, user_report_text):
    """`cat a.gz b.gz > ab.gz` (rotated logs joined): the report sits in the second member."""
    path = tmp_path / "joined.log.gz"
    path.write_bytes(gzip.compress(b"[rank0]: step 1 loss 0.5\n" * 1000) + gzip.compress(user_report_text.encode()))
    report = diagnose([path])
    assert report["error"] == "gloo-timeout" and report["ranks"] == [1136, 1139] and not report.truncated


def test_a_corrupt_gzip_is_read_up_to_the_damage_and_said(tmp_path, user_report_text):
    path = tmp_path / "log.gz"
    # INJECTED: bytes that are no gzip member after a whole one (a log with junk written after it)
    path.write_bytes(gzip.compress((user_report_text + "\n").encode()) + b"\x00\xffnot a gzip member" * 10)
    report = diagnose([path])
    assert report["error"] == "gloo-timeout" and report["ranks"] == [1136, 1139]
    assert len(report.truncated) == 1 and "corrupt gzip" in report.truncated[0]


def test_a_directory_with_no_log_files_is_one_line_of_bad_input(tmp_path):
    (tmp_path / "empty").mkdir()
    proc = subprocess.run([sys.executable, "-m", "ckptdoctor.cli", "diagnose", str(tmp_path / "empty")],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "is a directory with no log files in it" in proc.stderr


@pytest.mark.parametrize("at", [BLOCK - 40, BLOCK - 5, BLOCK + 3])
def test_a_finding_across_the_block_boundary_is_found_whole(tmp_path, at):
    """The timeout line placed so that it starts just before, or straddles, the 1 MiB block edge."""
    error = "[rank5]: RuntimeError: [../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out " \
            "waiting 1800000ms for recv operation to complete"
    head = "\n".join(traceback_lines(5, SAVE_OPTIM_28, "")[:-1]) + "\n"
    filler = "x" * (at - len(head) - 1) + "\n"
    path = tmp_path / "log"
    path.write_text(head + filler + error + "\n")
    assert path.read_text().index("Timed out") - (at - len(head) - 1) > 0
    report = diagnose([path])
    assert report["timeout_ms"] == 1_800_000 and report["ranks"] == [5]


def test_one_line_of_many_megabytes_is_read_in_bounded_memory(tmp_path, user_report_text):
    path = tmp_path / "one-line.log"
    one = user_report_text.replace("\n", " ")
    path.write_text(("x" * 997 + " ") * 8_000 + one + " " + ("y" * 997 + " ") * 8_000)  # ~16 MB, no newline
    tracemalloc.start()
    report = diagnose([path])
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert report["error"] == "gloo-timeout" and report["ranks"] == [1136, 1139]
    assert peak < 20_000_000, peak

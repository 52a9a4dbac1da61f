"""Ranks forked from the zygote start as `python script.py` / `python -m module` would: the
same argv, sys.path[0], directory, environment, exit status, atexit handlers and session;
only torch is already imported. A variable torch reads at import that differs from the
zygote's makes the launcher start a fresh interpreter instead."""

import json
import signal
import sys
import textwrap

import pytest

from ckptdoctor.repro.launcher import launch
from ckptdoctor.repro.zygote import Zygote

RANK = textwrap.dedent("""
    import atexit, json, os, sys
    preloaded = "torch" in sys.modules  # before this script imports anything of its own
    rank = int(os.environ["RANK"])
    out = sys.argv[1]
    atexit.register(lambda: open(f"{out}/atexit{rank}", "w").write("ran"))
    json.dump({"argv": sys.argv, "path0": sys.path[0], "cwd": os.getcwd(), "knob": os.environ.get("KNOB"),
               "main": __name__, "session_leader": os.getsid(0) == os.getpid(), "preloaded": preloaded,
               "stdin": os.read(0, 10).decode()}, open(f"{out}/rank{rank}.json", "w"))
    print(f"rank {rank} says hello", flush=True)
    if rank == 1:
        raise ValueError("rank 1 fails as a script does")
    sys.exit(int(sys.argv[2]))
""")


def run_job(tmp_path, code, preloaded, env=None):
    script = tmp_path / "job" / "rank.py"
    script.parent.mkdir()
    script.write_text(RANK)
    out = tmp_path / "out"
    out.mkdir()
    result = launch([str(script), str(out), str(code)], 2, tmp_path / "job.log", timeout_s=120, grace_s=60,
                    env={"KNOB": "set by the launch", **(env or {})}, preloaded=preloaded)
    reports = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    return result, reports, out


@pytest.mark.parametrize("preloaded", [True, False])
def test_a_forked_rank_starts_as_a_fresh_interpreter_would_with_torch_imported(tmp_path, preloaded):
    result, reports, out = run_job(tmp_path, 3, preloaded)
    assert result.returncodes == [3, 1]
    log = result.log_path.read_text()
    assert "[rank0]: rank 0 says hello" in log and "[rank1]: ValueError: rank 1 fails as a script does" in log
    for rank, report in enumerate(reports):
        assert report["argv"] == [str(tmp_path / "job" / "rank.py"), str(out), "3"]
        assert report["path0"] == str(tmp_path / "job") and report["main"] == "__main__"
        assert report["knob"] == "set by the launch" and report["session_leader"] and report["stdin"] == ""
        assert report["preloaded"] is preloaded
        assert (out / f"atexit{rank}").read_text() == "ran"  # after sys.exit and after an uncaught exception


def test_a_module_run_with_dash_m_gets_its_file_in_argv_and_the_directory_in_sys_path(tmp_path, monkeypatch):
    (tmp_path / "probe_mod.py").write_text("import json, os, sys\n"
                                           "json.dump([sys.argv, sys.path[0], __name__], open(sys.argv[1], 'w'))\n")
    monkeypatch.chdir(tmp_path)
    result = launch(["-m", "probe_mod", "seen.json"], 1, tmp_path / "job.log", timeout_s=60, preloaded=True)
    assert result.returncodes == [0], result.log_path.read_text()
    argv, path0, name = json.loads((tmp_path / "seen.json").read_text())
    assert argv == [str(tmp_path / "probe_mod.py"), "seen.json"] and path0 == str(tmp_path) and name == "__main__"


def test_a_variable_torch_reads_at_import_that_differs_takes_a_fresh_interpreter(tmp_path):
    _, reports, _ = run_job(tmp_path, 0, True, env={"OMP_NUM_THREADS": "2"})
    assert [r["preloaded"] for r in reports] == [False, False]


def test_a_rank_killed_by_a_signal_reports_it_as_subprocess_does(tmp_path):
    (tmp_path / "sleeper.py").write_text("import time\ntime.sleep(600)\n")
    zygote = Zygote.get(sys.executable, {"OMP_NUM_THREADS": "1"})
    rank = zygote.fork([str(tmp_path / "sleeper.py")], {"OMP_NUM_THREADS": "1"})
    assert rank.poll() is None
    rank.send_signal(signal.SIGKILL)
    assert rank.wait(timeout=60) == -signal.SIGKILL

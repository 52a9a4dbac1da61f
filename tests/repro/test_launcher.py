"""The lab's launcher: ranks as real processes, torn down as torchrun's agent would, and at once
when only stopped ranks are left (a frozen rank cannot end on its own); under torchrun, a frozen
rank is killed as soon as torchrun asks it to terminate."""

import signal
import subprocess
import sys
import textwrap
import time

from ckptdoctor.repro.launcher import launch, wait_for_torchrun

RANK = textwrap.dedent("""
    import os, signal, sys, time
    rank = int(os.environ["RANK"])
    if rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)   # frozen, as a node that vanished
    time.sleep(float(sys.argv[2]))             # rank 0: still working while rank 1 is stopped
    print(f"rank {rank} done", flush=True)
    sys.exit(int(sys.argv[1]))
""")


def run(tmp_path, code: int, work_s: float):
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    return launch([str(script), str(code), str(work_s)], 2, tmp_path / "job.log", grace_s=600, timeout_s=600)


def test_a_stopped_rank_is_torn_down_once_every_other_rank_has_ended(tmp_path):
    for code in (0, 3):  # after a success, and after a failure (instead of waiting out the grace)
        result = run(tmp_path, code, work_s=1.0)
        assert result.torn_down == [1] and result.returncodes == [code, -signal.SIGKILL]
        assert "[rank0]: rank 0 done" in result.log_path.read_text()  # rank 0 was let finish first


TORCHRUN_LIKE = textwrap.dedent("""
    import os, signal, subprocess, sys
    # as torchrun's agent: one rank, which freezes; then SIGTERM to it and up to 30 s before a SIGKILL
    rank = subprocess.Popen([sys.executable, "-c", "import os, signal, sys; "
                             "open(sys.argv[1], 'w').write(str(os.getpid())); os.kill(os.getpid(), signal.SIGSTOP)",
                             sys.argv[1]])
    while not os.path.exists(sys.argv[1]) or open(f"/proc/{rank.pid}/stat").read().split(") ")[1][0] != "T":
        pass  # the pid is written, and the rank is stopped
    rank.send_signal(signal.SIGTERM)
    try:
        print("rank ended:", rank.wait(timeout=30))
    except subprocess.TimeoutExpired:
        print("the agent waited out its 30 s")
        rank.kill()
""")


def test_under_torchrun_a_frozen_rank_asked_to_terminate_is_killed_at_once(tmp_path):
    agent = tmp_path / "agent.py"
    agent.write_text(TORCHRUN_LIKE)
    proc = subprocess.Popen([sys.executable, str(agent), str(tmp_path / "frozen_pid")], stdout=subprocess.PIPE,
                            text=True, start_new_session=True)
    assert wait_for_torchrun(proc, tmp_path / "frozen_pid", time.time() + 600) == 0
    assert proc.stdout.read() == f"rank ended: {-signal.SIGKILL}\n"  # within the agent's wait, not after it

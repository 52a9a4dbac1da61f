"""The lab's launcher: ranks as real processes, torn down as torchrun's agent would, and at once
when only stopped ranks are left (a frozen rank cannot end on its own)."""

import signal
import textwrap

from ckptdoctor.repro.launcher import launch

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

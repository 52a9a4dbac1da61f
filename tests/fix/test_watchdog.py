"""The save watchdog on a real 4-rank gloo save whose coordinator is held in planning."""

import re

import pytest

from ckptdoctor.repro.launcher import launch

from support.paths import JOBS

JOB = JOBS / "watchdog_job.py"


@pytest.mark.slow
def test_every_rank_writes_its_stack_and_rank0_logs_one_summary_before_the_deadline(tmp_path):
    result = launch([str(JOB), str(tmp_path)], 4, tmp_path / "job.log", timeout_s=300)
    log = (tmp_path / "job.log").read_text()
    assert result.returncodes == [0] * 4, log[-3000:]  # the watchdog did not break or hang the save
    rank0 = (tmp_path / "watchdog" / "rank0.txt").read_text()
    assert rank0.startswith("rank 0: global plan (create_global_plan) for ")
    assert "create_global_plan" in rank0.split("\n", 1)[1]  # the Python stack shows where it was
    for rank in (1, 2, 3):
        text = (tmp_path / "watchdog" / f"rank{rank}.txt").read_text()
        assert text.startswith(f"rank {rank}: waiting for the plan (gather + scatter) for ")
        assert "scatter_object_list" in text and "broadcast" in text
    summaries = [line for line in re.findall(r"ckptdoctor watchdog: (.*)", log) if "stacks in" not in line]
    assert len(summaries) == 1, log[-3000:]
    assert re.fullmatch(r"rank 0: global plan \(create_global_plan\) for \d+ s; "
                        r"ranks 1-3: waiting for the plan \(gather \+ scatter\) for \d+ s", summaries[0].strip())

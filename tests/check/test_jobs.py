"""The job protocol: a job forked from the fork server answers what the job's own command line
answers in a fresh interpreter; a failing job is one line, in either."""

import dataclasses
import json
import os
import subprocess
import sys

import pytest

from ckptdoctor.check.jobs import run_job
from ckptdoctor.check.mova_shape import MovaShape
from ckptdoctor.errors import CkptDoctorError

JOB = {"kind": "plans", "shape": dataclasses.asdict(MovaShape().with_layers(2)), "mode": "sft", "layout": "hsdp:2",
       "save": "optimizer", "ranks": 4}


def test_a_forked_job_answers_what_a_fresh_interpreter_answers():
    forked = run_job(sys.executable, JOB)
    fresh = subprocess.run([sys.executable, "-m", "ckptdoctor.check.jobs", json.dumps(JOB)], capture_output=True,
                           text=True, check=True).stdout
    assert forked == json.loads(fresh.strip().splitlines()[-1])
    plans = forked["plans"]
    assert len(plans) == 4 and all(plans)  # every rank's plan, none empty


def test_each_job_is_a_process_of_its_own_and_the_server_outlives_a_failure():
    with pytest.raises(CkptDoctorError, match=r"^simulation job nope failed: ValueError: unknown job kind 'nope'$"):
        run_job(sys.executable, JOB | {"kind": "nope"})
    assert run_job(sys.executable, JOB)["plans"]  # the next job runs


def test_a_job_in_another_interpreter_runs_its_command_line_and_fails_in_one_line_too():
    other = os.path.join(os.path.dirname(sys.executable), ".", os.path.basename(sys.executable))  # not this one's name
    assert run_job(other, JOB) == run_job(sys.executable, JOB)
    with pytest.raises(CkptDoctorError, match=r"^simulation job nope failed in .*unknown job kind 'nope'"):
        run_job(other, JOB | {"kind": "nope"})

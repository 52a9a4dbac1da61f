"""One measurement, one process: the job protocol between `check`'s models and its phases.

A model (save_model.py, load_model.py) runs in the user's interpreter and never imports torch's
planner; each measurement it needs is a job, run in a process of its own (the memory it reports is
the job's). The job names its `kind` (one of `KINDS`), the save and its source (MOVA's shape and
mode, or an existing checkpoint: `Workload.source`), the layout and N. The process builds the
state dicts (`job_specs`), runs the phase function registered for the kind (save_phases.py,
load_phases.py) and answers one JSON object, with the torch that measured it. `run_job` runs it:

* in this interpreter (`check`, always): a child forked from a fork server (the standard
  library's "forkserver" start method) that imported torch and the phases once. Each job is a
  fresh fork of it, so it starts in a fraction of a second instead of importing torch anew (3 s
  here, per job; `check --ranks 16 --layout hsdp:8` runs 14 jobs). A fork starts with its own
  memory high-water mark, and each phase counts its peak from its own start (fake_world.py).
* in another interpreter (the lab's other stack): `python -m ckptdoctor.check.jobs '<job as
  JSON>'`, which prints the answer as one JSON line.
"""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
import os
import subprocess
import sys
import threading
import traceback
from pathlib import Path

from ..errors import CkptDoctorError
from .layout import Layout
from .mova_shape import MovaShape

HERE = "here"  # this interpreter and the torch installed with it (an installed wheel, no checkout)


@dataclasses.dataclass
class Workload:
    """The saves to measure (MOVA's in `mode`, or existing checkpoints'), where and at which N."""

    ranks: list[int]
    layouts: list[Layout]
    mode: str = "sft"
    stacks: list[str] = dataclasses.field(default_factory=lambda: [HERE])
    saves: tuple[str, ...] = ("model", "optimizer")
    shape: MovaShape = dataclasses.field(default_factory=MovaShape.real)
    checkpoints: dict[str, str] = dataclasses.field(default_factory=dict)  # save name -> a DCP checkpoint's directory

    def source(self, save: str) -> dict:
        """What a job needs to build `save`'s state dicts (`job_specs` reads it)."""
        if save in self.checkpoints:
            return {"checkpoint": self.checkpoints[save]}
        return {"shape": dataclasses.asdict(self.shape), "mode": self.mode}


def here_only(stack: str) -> str:
    """The interpreter for `stack`: the product measures only the torch installed with it."""
    if stack != HERE:
        raise CkptDoctorError(f"stack {stack!r} is the lab's (a checkout's .venv); check measures the torch installed here")
    return sys.executable


def run_job(python: str, job: dict) -> dict:
    """One measurement job in a process of its own, in `python`; its JSON answer."""
    if python == sys.executable:
        return _run_forked(job)
    proc = subprocess.run([python, "-m", __name__, json.dumps(job)],
                          capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if proc.returncode != 0:
        raise CkptDoctorError(f"simulation job {job.get('kind')} failed in {python}: "
                              f"{proc.stderr.strip().splitlines()[-1:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# What the fork server imports once, so that no job imports it: torch and the phases.
PRELOAD = ["torch", "torch.distributed.checkpoint", "torch.distributed.tensor", f"{__package__}.save_phases",
           f"{__package__}.load_phases", f"{__package__}.state_dicts"]
_server_lock = threading.Lock()
_server = None


def _fork_context():
    """The fork server's context, started on first use (one per process)."""
    global _server
    with _server_lock:
        if _server is None:
            context = multiprocessing.get_context("forkserver")
            context.set_forkserver_preload(PRELOAD)
            _server = context
        return _server


def _run_forked(job: dict) -> dict:
    context = _fork_context()
    receive, send = context.Pipe(duplex=False)
    child = context.Process(target=_forked_job, args=(job, dict(os.environ), send), daemon=True)
    child.start()
    send.close()
    try:
        answer = receive.recv()
    except EOFError:
        answer = {"error": "the process ended without an answer"}
    finally:
        receive.close()
        child.join()
    if "error" in answer:
        detail = f" (exit code {child.exitcode})" if child.exitcode else ""
        raise CkptDoctorError(f"simulation job {job.get('kind')} failed: {answer['error']}{detail}")
    return answer["result"]


def _forked_job(job: dict, environ: dict, send) -> None:
    """A job's process, forked from the server: the caller's environment, one answer on `send`."""
    os.environ.clear()
    os.environ.update(environ)
    try:
        import torch

        torch.set_num_threads(1)  # as OMP_NUM_THREADS=1 does for the other interpreters' jobs
        send.send({"result": answer(job)})
    except BaseException as error:  # every failure: the caller reports it in one line
        last = traceback.format_exception_only(type(error), error)[-1].strip()
        send.send({"error": last})
    finally:
        send.close()


# -- inside the job's process -------------------------------------------------------------------

def job_specs(job: dict):
    """The state dicts a job plans: an existing checkpoint's entries, or MOVA's parameters."""
    from .state_dicts import mova_specs, read_checkpoint_entries

    if "checkpoint" in job:
        return read_checkpoint_entries(Path(job["checkpoint"]))[0]
    return mova_specs(MovaShape(**job["shape"]), job["mode"])


def _coordinator(job, specs, layout):
    from .save_phases import measure_coordinator

    return dataclasses.asdict(measure_coordinator(job["save"], specs, job["ranks"], layout,
                                                  planner=job.get("planner", "stock"),
                                                  validation_sample=job.get("validation_sample")))


def _planning(job, specs, layout):
    from .save_phases import measure_planning_ours

    return measure_planning_ours(job["save"], specs, job["ranks"], layout)


def _validation(job, specs, layout):
    from .save_phases import validation_seconds_per_tensor

    return {"per_class": [[list(shape), count, validation_seconds_per_tensor(shape, job["ranks"], layout)]
                          for shape, count in specs.sharded_shapes(job["save"]).items()]}


def _plans(job, specs, layout):
    from .save_phases import simulated_plans

    return {"plans": simulated_plans(job["save"], specs, job["ranks"], layout)}


def _verify(job, specs, layout):
    from .save_phases import verify_derivation

    return {"ranks_checked": verify_derivation(job["save"], specs, job["ranks"], layout, job["sample_ranks"])}


def _load_write_stock(job, specs, layout):
    from .load_phases import write_stock

    return write_stock(job["save"], specs, job["ranks"], layout, Path(job["dir"]))


def _load_write_ours(job, specs, layout):
    from .load_phases import write_ours

    return write_ours(job["save"], specs, job["ranks"], layout, Path(job["dir"]), job["with_metadata"])


def _load_read(job, specs, layout):
    from .load_phases import measure_read

    return measure_read(Path(job["dir"]), job["reader"])


def _load_plan(job, specs, layout):
    from .load_phases import measure_planning

    return measure_planning(job["save"], specs, job["ranks"], layout)


def _load_plans(job, specs, layout):
    from .load_phases import simulated_read_plans

    return {"plans": simulated_read_plans(job["save"], specs, job["ranks"], layout)}


KINDS = {  # a job's kind -> what its process runs (save_phases.py, load_phases.py)
    "coordinator": _coordinator, "planning": _planning, "validation": _validation, "plans": _plans,
    "verify": _verify, "load-write-stock": _load_write_stock, "load-write-ours": _load_write_ours,
    "load-read": _load_read, "load-plan": _load_plan, "load-plans": _load_plans,
}


def answer(job: dict) -> dict:
    """Run `job` in this process: its kind's phase function, with the torch that measured it."""
    import warnings

    import torch

    warnings.filterwarnings("ignore")
    if job["kind"] not in KINDS:
        raise ValueError(f"unknown job kind {job['kind']!r}")
    out = KINDS[job["kind"]](job, job_specs(job), Layout.parse(job["layout"]))
    return json.loads(json.dumps(out | {"torch": torch.__version__.split("+")[0]}))


def main(argv=None) -> int:
    """A job's process in another interpreter: one JSON job as the argument, one JSON line out."""
    print(json.dumps(answer(json.loads((argv or sys.argv[1:])[0]))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

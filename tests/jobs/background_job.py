"""One rank of a real Accelerate FSDP2 job (CPU offload, as MOVA runs it) saving asynchronously
(CKPTDOCTOR_ASYNC=1 from the test, `ckptdoctor.install` after prepare), started by
tests/fix/test_background.py.

    python background_job.py OUT SCENARIO

Every scenario trains a step and saves OUT/ckpt/step-1, then:
  roundtrip  trains while step-1 is in flight (a barrier on the training group too), saves step-2,
             loads step-1 back (bit for bit: parameters and optimizer state), saves step-3 and
             ends: normal exit, or with `sigterm` every rank sends itself SIGTERM right after
             save_state returns; step-3 must be published all the same
  nospace    step-2 runs out of space in the background (OUT/ckpt is a small tmpfs): the next
             checkpoint call (wait) raises, then latest() names step-1
  kill       rank 2 SIGKILLs itself while step-2 is in flight; the others' next call raises
  memory     (instead of step-1's save) every rank joins the memory cgroup CKD_CGROUP at start;
             after the first training step rank 0 sets its limit to its usage + 8 MiB, and the
             staging copy needs 3 MiB per rank x 4 ranks: the first async save is refused in one
             line on every rank, nothing written
Each rank writes OUT/rank<N>.json (what it saw).
"""

import hashlib
import json
import os
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from accelerate import Accelerator, FullyShardedDataParallelPlugin

from ckptdoctor.selftest.accelerate_cpu import enable_fsdp_on_cpu, unpinned_cpu_offload

out, scenario = Path(sys.argv[1]), sys.argv[2]
rank = int(os.environ["RANK"])
report = {"rank": rank}
ckpt_root = out / "ckpt"
if scenario == "memory":
    (Path(os.environ["CKD_CGROUP"]) / "cgroup.procs").write_text(str(os.getpid()))


def finish(**fields):
    report.update(fields)
    (out / f"rank{rank}.json").write_text(json.dumps(report))


def digest(model, optimizer) -> str:
    """This rank's parameter shards and its optimizer state's tensors."""
    tensors = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]
    for state in optimizer.optimizer.state.values():
        tensors += [v.to_local() if hasattr(v, "to_local") else v for v in state.values() if torch.is_tensor(v)]
    return hashlib.sha256(b"".join(t.detach().contiguous().numpy().tobytes() for t in tensors)).hexdigest()


dist.init_process_group("gloo")
enable_fsdp_on_cpu()
unpinned_cpu_offload()
plugin = FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type="SHARDED_STATE_DICT", cpu_offload=True)
accelerator = Accelerator(cpu=True, fsdp_plugin=plugin)
torch.manual_seed(0)
width = 1024 if scenario == "memory" else 256  # memory: 4 MiB of weights, 12 MiB with Adam's state
model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Linear(width, 8))
optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
model, optimizer = accelerator.prepare(model, optimizer)

import ckptdoctor  # noqa: E402 - after prepare, as the README says

ckpt = ckptdoctor.install(accelerator)


def step(value):
    accelerator.backward(model(torch.full((4, width), value)).sum())
    optimizer.step()
    optimizer.zero_grad()


def saving(name):
    """save_state; whether the save was still in flight when it returned."""
    accelerator.save_state(str(ckpt_root / name))
    return ckpt._background.in_flight()


step(1.0)
if scenario == "memory":
    dist.barrier()
    if rank == 0:
        group = Path(os.environ["CKD_CGROUP"])
        usage = int((group / "memory.usage_in_bytes").read_text())
        (group / "memory.limit_in_bytes").write_text(str(usage + (8 << 20)))
    dist.barrier()
    try:
        saving("step-1")
    except Exception as error:  # noqa: BLE001 - the one line is the test's subject
        report.update(error_type=type(error).__name__, error=str(error))
    report["written"] = sorted(str(p.relative_to(ckpt_root)) for p in ckpt_root.rglob("*")) if ckpt_root.exists() else []
    finish(status="ok")
    sys.exit(0)
report["in_flight_after_return"] = saving("step-1")
report["saved"] = digest(model, optimizer)
try:
    if scenario == "roundtrip":
        step(2.0)  # the parameters and optimizer state change while step-1 is written from its copy
        report["in_flight_at_barrier"] = ckpt._background.in_flight()
        dist.barrier()  # the training group: never the background save's
        saving("step-2")
        accelerator.load_state(str(ckpt_root / "step-1"))
        report["loaded"] = digest(model, optimizer)
        step(3.0)
        report["step3"] = digest(model, optimizer)
        report["in_flight_at_end"] = saving("step-3")
        report["host_copy"] = ckpt._background.copies.bytes
        finish(status="ended")
        if "sigterm" in sys.argv[3:]:
            os.kill(os.getpid(), signal.SIGTERM)
        sys.exit(0)  # step-3 is in flight: the exit waits for it
    if scenario == "nospace":
        step(2.0)
        saving("step-2")
        try:
            ckpt.wait()
        except Exception as error:  # noqa: BLE001 - the one line is the test's subject
            report.update(error_type=type(error).__name__, error=str(error))
        report["latest"] = str(ckpt.latest(ckpt_root))
    if scenario == "kill":
        step(2.0)
        report["in_flight_before_kill"] = saving("step-2")
        if rank == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        try:
            ckpt.wait()
        except Exception as error:  # noqa: BLE001
            report.update(error_type=type(error).__name__, error=str(error))
except Exception as error:  # noqa: BLE001
    report.update(unexpected=f"{type(error).__name__}: {error}")
finish(status="ok")

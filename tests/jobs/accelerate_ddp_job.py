"""One rank of a real Accelerate job on CPU processes (MULTI_CPU: DDP over gloo), started by
tests/fix/test_install.py with ACCELERATE_USE_CPU=true, as `accelerate launch --cpu` starts one.

    python accelerate_ddp_job.py OUT stock|fix [kill] [fsdp1|fsdp2] [full] [offload]

Automatic checkpoint naming with total_limit=2: three saves with a training step between each,
a load back of the newest (load_state() with no directory), then (fix only) a fourth save that
fails on rank 1 alone (INJECTED: a registered object whose state_dict raises there).
Each rank writes OUT/rank<N>.json. With `kill`: two saves, then rank 1 SIGKILLs itself at the
start of the third (a save-state pre-hook, after stock has deleted the oldest checkpoint to make
room, before rank 1 wrote anything); the test reads what is left on disk. With `fsdp2`: the model
is sharded by Accelerate's FSDP2 path (SHARDED_STATE_DICT, so every save and load goes through DCP),
made to run on CPU processes the way `ckptdoctor selftest` does (selftest/accelerate_cpu.py). With
`fsdp1`: FSDP1 the same way (its state dicts hold ShardedTensors), the model wrapped here on the CPU
device. `full`: FULL_STATE_DICT instead (on CPU processes, torch 2.8.0, rank 0 segfaults in
libtorch_cpu during FSDP1's full optimizer state dict, in stock Accelerate as with the fix: no test
uses it). `offload`: FSDP's CPU offload (Accelerate's `cpu_offload=True`, as MOVA's config sets it).
"""

import hashlib
import json
import os
import signal
import sys
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType, ProjectConfiguration

out, mode = Path(sys.argv[1]), sys.argv[2]
kill = "kill" in sys.argv[3:]
fsdp = next((int(a[4:]) for a in sys.argv[3:] if a in ("fsdp1", "fsdp2")), None)  # FSDP's version, or None: DDP
state_dict_type = "FULL_STATE_DICT" if "full" in sys.argv[3:] else "SHARDED_STATE_DICT"
offload = "offload" in sys.argv[3:]  # FSDP's parameters and optimizer state held on the host between uses
rank = int(os.environ["RANK"])


class FailsOnRank1:
    armed = False

    def state_dict(self):
        if self.armed and rank == 1:
            raise OSError(28, "No space left on device (injected)")
        return {}

    def load_state_dict(self, state):
        pass


def digest(model) -> str:
    """This rank's parameters (its shards, under FSDP2)."""
    local = [getattr(p, "to_local", lambda p=p: p)().detach() for p in model.parameters()]
    return hashlib.sha256(b"".join(t.numpy().tobytes() for t in local)).hexdigest()


def step(model, optimizer, accelerator, value):
    accelerator.backward(model(torch.full((4, 6), value)).sum())
    optimizer.step()
    optimizer.zero_grad()


report = {"rank": rank}
config = ProjectConfiguration(project_dir=str(out / "project"), automatic_checkpoint_naming=True, total_limit=2)
if fsdp:
    import torch.distributed as dist
    from accelerate import FullyShardedDataParallelPlugin

    from ckptdoctor.selftest.accelerate_cpu import enable_fsdp_on_cpu, unpinned_cpu_offload

    dist.init_process_group("gloo")
    enable_fsdp_on_cpu()
    if offload:
        unpinned_cpu_offload()
    plugin = FullyShardedDataParallelPlugin(fsdp_version=fsdp, state_dict_type=state_dict_type, cpu_offload=offload)
    accelerator = Accelerator(cpu=True, project_config=config, fsdp_plugin=plugin)
else:
    accelerator = Accelerator(project_config=config)
report["distributed_type"] = str(accelerator.distributed_type)
assert accelerator.distributed_type == (DistributedType.FSDP if fsdp else DistributedType.MULTI_CPU)
torch.manual_seed(0)
model = torch.nn.Linear(6, 3)
if fsdp == 1:  # wrapped here: Accelerate's own FSDP1 wrap names the device "cpu:0", which FSDP1 refuses on CPU
    from torch.distributed.fsdp import FullyShardedDataParallel

    model = FullyShardedDataParallel(model, use_orig_params=True, device_id=torch.device("cpu"))
optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
model, optimizer = accelerator.prepare(model, optimizer)
extra = FailsOnRank1()
accelerator.register_for_checkpointing(extra)
if mode == "fix":
    import ckptdoctor

    ckptdoctor.install(accelerator)
if kill:
    saves = []

    def die_on_the_third_save(models, weights, output_dir):
        saves.append(output_dir)
        if len(saves) == 3 and rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)

    accelerator.register_save_state_pre_hook(die_on_the_third_save)
for value in (1.0, 2.0, 3.0):
    step(model, optimizer, accelerator, value)
    accelerator.save_state()
saved = digest(model)
step(model, optimizer, accelerator, 4.0)
moved = digest(model)
accelerator.load_state()
report.update(saved=saved, moved=moved, loaded=digest(model), iteration=accelerator.save_iteration)
if mode == "fix":
    extra.armed = True
    try:
        accelerator.save_state()
    except Exception as error:  # noqa: BLE001 - the one line is the test's subject
        report.update(error_type=type(error).__name__, error=str(error), is_oserror=isinstance(error, OSError))
accelerator.wait_for_everyone()
root = out / "project" / "checkpoints"
report["checkpoints"] = sorted(p.name for p in root.iterdir())
report["complete"] = sorted(p.name for p in root.iterdir() if (p / "CKPTDOCTOR_COMPLETE").is_file())
(out / f"rank{rank}.json").write_text(json.dumps(report))

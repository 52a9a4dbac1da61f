"""The fix's save and loads on the job's own device and launcher, proved by checksums.

Each rank hashes its own shards (parameters and AdamW state, in name order) before the save;
after each load (the fix's, then stock Accelerate's) its hash must be the same. Between them
the shards are zeroed, so a load that read nothing cannot pass."""

from __future__ import annotations

import datetime
import hashlib
import time
from pathlib import Path

from .backend import Job
from .checks import Check, timed


class TrainedModel:
    """A MOVA-shaped model prepared by Accelerate with FSDP2 (SHARDED_STATE_DICT, each block
    wrapped), and `steps` optimizer steps taken."""

    def __init__(self, job: Job, width: int, layers: int, steps: int, offload: bool):
        import torch
        from accelerate import Accelerator, FullyShardedDataParallelPlugin
        from torch.distributed.fsdp import CPUOffloadPolicy

        from .model import MovaShapedModel, batch

        if job.device == "cpu":
            from .accelerate_cpu import enable_fsdp_on_cpu
            enable_fsdp_on_cpu()
        plugin = FullyShardedDataParallelPlugin(
            fsdp_version=2, state_dict_type="SHARDED_STATE_DICT", reshard_after_forward=True,
            auto_wrap_policy="transformer_based_wrap", transformer_cls_names_to_wrap=["SelftestBlock"],
            cpu_offload=CPUOffloadPolicy(pin_memory=job.device != "cpu") if offload else False)
        self.accelerator = Accelerator(cpu=job.device == "cpu", mixed_precision="bf16", fsdp_plugin=plugin)
        torch.manual_seed(1234)
        model = MovaShapedModel(width, layers)
        self.parameters = sum(p.numel() for p in model.parameters())
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        self.model, self.optimizer = self.accelerator.prepare(model, optimizer)
        device = job.torch_device()  # with offload too: FSDP brings the parameters to the device to compute
        for step in range(steps):
            video, audio = batch(width, seed=1000 * step + job.rank, device=device)
            self.accelerator.backward(self.model(video, audio))
            self.optimizer.step()
            self.optimizer.zero_grad()

    def checkpoint_bytes(self) -> int:
        """Parameters and AdamW's two moments in fp32, the whole model (every rank's shards)."""
        return 12 * self.parameters

    def digest(self) -> str:
        """sha256 of this rank's shards: every parameter and its optimizer state, by name."""
        digest = hashlib.sha256()
        for name, param in sorted(self.model.named_parameters()):
            digest.update(name.encode())
            digest.update(_local_bytes(param))
            for key, value in sorted(self.optimizer.state.get(param, {}).items()):
                digest.update(key.encode())
                digest.update(_local_bytes(value) if hasattr(value, "shape") else repr(value).encode())
        return digest.hexdigest()

    def scramble(self) -> None:
        """Zero every shard and optimizer state in place: a load must bring them back."""
        import torch

        with torch.no_grad():
            for param in self.model.parameters():
                param.zero_()
                for value in self.optimizer.state.get(param, {}).values():
                    if hasattr(value, "zero_"):
                        value.zero_()


def _local_bytes(tensor) -> bytes:
    import torch

    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def save_with_the_fix(ckpt, step_dir: Path, in_flight: TrainedModel | None = None) -> Check:
    """Every rank: the save through the fix; its phases, and which torch can read what it wrote.
    With `in_flight` (an async save), that model's shards are zeroed as soon as save_state returns,
    while the background writes: what is published must be the copy taken before."""
    from ..fix.index import read_metadata_file
    from ..fix.metadata_format import describe_format

    def work():
        started = time.monotonic()
        ckpt.save_state(step_dir / "accelerator")
        stalled, values, stall = time.monotonic() - started, {}, ""
        if in_flight is not None:
            in_flight.scramble()
            ckpt.wait()
            copy = ckpt.last_operation.host_copy
            values = {"stalled_s": round(stalled, 3), "background_s": round(ckpt.last_operation.ended - started - stalled, 3),
                      "host_copy_bytes": copy}
            stall = (f"training waited {stalled:.2f} s for a {copy / 1e6:.1f} MB host copy, the rest ran in the "
                     f"background while the shards were zeroed; ")
        phases = {name: round(s, 3) for name, s in ckpt.last_operation.phases.items()}
        slowest = ", ".join(f"{n} {s:.2f} s" for n, s in sorted(phases.items(), key=lambda x: -x[1])[:3])
        written = describe_format(read_metadata_file(step_dir / "accelerator" / "pytorch_model_fsdp_0"))
        return True, f"{stall}published {step_dir / 'accelerator'} ({slowest}); {written}", {
            "phases_s": phases, "format": written, **values}
    return timed("save (fix)", work)


def visible(path: Path, wait_s: float) -> Check:
    """Every rank: the published step counts as complete here (its marker and every `.metadata`
    seen by this host), within `wait_s`."""
    from ..fix.publish import counts_as_checkpoint

    def work():
        started = time.monotonic()
        while not counts_as_checkpoint(path, legacy=False):
            if time.monotonic() - started > wait_s:
                return False, f"{path} not complete on this rank after {wait_s:.0f} s", {}
            time.sleep(0.2)
        return True, f"complete on every rank, after {time.monotonic() - started:.2f} s at most", {}
    return timed("visible on every rank", work)


def load_and_compare(name: str, load, trained: TrainedModel, expected: str) -> Check:
    def work():
        trained.scramble()
        if trained.digest() == expected:
            return False, "zeroing the shards did not change their checksum: the comparison would prove nothing", {}
        load()
        got = trained.digest()
        if got != expected:
            return False, f"shards differ from the saved ones after the load (sha256 {got[:12]} != {expected[:12]})", {}
        return True, "every rank's shards equal the saved ones (sha256 of parameters and optimizer state)", {}
    return timed(name, work)


def stock_plan_exchange(trained: TrainedModel, path: Path, deadline_s: float) -> Check:
    """Stock DCP's save of the same state (DefaultSavePlanner, FileSystemWriter) on a gloo group
    with its own long deadline: how long each rank waits in the plan exchange."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemWriter
    from torch.distributed.checkpoint.state_dict import get_state_dict

    class TimedPlanner(DefaultSavePlanner):
        def create_local_plan(self):
            plan = super().create_local_plan()
            self.local_done = time.monotonic()
            return plan

        def create_global_plan(self, all_plans):
            started = time.monotonic()
            result = super().create_global_plan(all_plans)
            self.global_s = time.monotonic() - started
            return result

        def finish_plan(self, new_plan):
            self.exchange_s = time.monotonic() - self.local_done
            return super().finish_plan(new_plan)

    def work():
        group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=deadline_s))
        model_state, optimizer_state = get_state_dict(trained.model, trained.optimizer)
        planner = TimedPlanner()
        dcp.save({"model": model_state, "optimizer": optimizer_state}, storage_writer=FileSystemWriter(path),
                 planner=planner, process_group=group)
        values = {"plan_exchange_s": round(planner.exchange_s, 3),
                  "rank0_global_plan_s": round(getattr(planner, "global_s", 0.0), 3)}
        return True, f"stock plan exchange {planner.exchange_s:.2f} s (deadline {deadline_s:.0f} s)", values
    return timed("stock plan exchange", work)

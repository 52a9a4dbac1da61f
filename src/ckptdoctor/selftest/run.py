"""The self-test's order of work, on every rank, and its verdict.

Every rank reaches the same collectives whatever fails on it: each check catches its own
errors and reports them, the fix's own failures are the same CheckpointAborted everywhere."""

from __future__ import annotations

import dataclasses
import datetime
import json
import shutil
import time
from pathlib import Path

from ..errors import CkptDoctorError
from .checks import Check, directory, directory_fsync, free_space, merge, mtime_granularity, open_files, store_capacity


@dataclasses.dataclass
class Options:
    dir: Path
    width: int = 256
    layers: int = 4
    steps: int = 2
    offload: bool = True
    stock: bool = False
    stock_deadline_s: float = 3 * 3600.0
    job_ranks: int | None = None     # the real job's world size (default: this run's)
    expect_gb: float | None = None   # the real job's checkpoint size, for the free-space check
    visibility_s: float = 60.0
    backend: str | None = None
    timeout_s: float = 1800.0
    keep: bool = False
    async_save: bool = False         # the save in the background (fix/background.py)

    def __post_init__(self):
        for flag, value in (("width", self.width), ("layers", self.layers), ("steps", self.steps),
                            ("timeout", self.timeout_s), ("visibility", self.visibility_s)):
            if value <= 0:
                raise CkptDoctorError(f"--{flag} must be positive, got {value}")
        if self.width % 2:
            raise CkptDoctorError(f"--width must be even (the audio tower is half as wide), got {self.width}")
        self.dir = Path(self.dir)


def run(opts: Options, progress=print) -> tuple[int, dict | None]:
    """Every rank: (exit status, rank 0's report or None on other ranks)."""
    import torch.distributed as dist

    from ..fix.heartbeat import job_store
    from .backend import start

    job = start(opts.backend, opts.timeout_s)
    coord = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=opts.timeout_s))
    job_ranks = opts.job_ranks or job.world_size
    say = progress if job.rank == 0 else (lambda line: None)
    root = _broadcast(coord, opts.dir.absolute() / f"ckptdoctor-selftest-{time.strftime('%Y%m%d-%H%M%S')}")
    say(f"ckptdoctor selftest: {job.world_size} rank(s), backend {job.backend} on {job.device}, in {root}")

    mine: list[Check] = [directory(root, job.rank)]
    writable = all(_gather(coord, mine[0].ok))
    mine += [directory_fsync(root) if writable else _skipped("directory fsync"), open_files(job_ranks),
             store_capacity(job_store(), job.rank, job.world_size, job_ranks)]
    say("  environment checked; building the model")
    trained, built = _build(job, opts)
    mine.append(built)
    rank0: list[Check] = []
    if job.rank == 0:
        need = int(2 * (opts.expect_gb * 1e9 if opts.expect_gb else trained.checkpoint_bytes() if trained else 0))
        rank0 += [free_space(root, need) if writable else _skipped("free space"),
                  mtime_granularity(root) if writable else _skipped("mtime granularity")]
    ready = writable and all(_gather(coord, trained is not None))
    mine += _round_trip(job, opts, trained, root, say) if ready else \
        [_skipped(n, "the directory is not writable on every rank" if not writable else "the model was not built")
         for n in ("checkpoint group", "save (fix)", "visible on every rank", "load (fix)", "load (stock)")]

    every = _gather(coord, mine)
    report = None
    if job.rank == 0:
        checks = [merge([ranks[i] for ranks in every]) for i in range(len(mine))] + rank0
        report = _report(job, opts, root, checks, trained)
        if not opts.keep:
            shutil.rmtree(root, ignore_errors=True)
    status = _broadcast(coord, None if report is None else (0 if report["passed"] else 1))
    dist.destroy_process_group()
    return status, report


def _round_trip(job, opts, trained, root: Path, say) -> list[Check]:
    import torch.distributed as dist

    from ..fix.checkpointing import ScalableCheckpointing
    from ..fix.settings import Settings
    from .roundtrip import load_and_compare, save_with_the_fix, stock_plan_exchange, visible

    timeout_s = Settings.resolve().timeout_s
    started = time.monotonic()
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
    dist.barrier(group=group)  # its connections are made by now
    created = Check("checkpoint group", True, time.monotonic() - started,
                    f"a gloo group of {job.world_size} rank(s), timeout {timeout_s:.0f} s")
    ckpt = ScalableCheckpointing(trained.accelerator, group=group, async_save=opts.async_save)
    expected = trained.digest()
    step = root / "step-1"
    say("  saving with the fix" + (" in the background" if opts.async_save else ""))
    checks = [created, save_with_the_fix(ckpt, step, trained if opts.async_save else None)]
    if not checks[-1].ok:
        return checks + [_skipped(n, "the save failed") for n in ("visible on every rank", "load (fix)", "load (stock)")]
    checks.append(visible(step / "accelerator", opts.visibility_s))
    say("  loading with the fix, then with stock Accelerate")
    checks.append(load_and_compare("load (fix)", lambda: ckpt.load_state(step / "accelerator"), trained, expected))
    checks.append(load_and_compare("load (stock)", lambda: ckpt._accelerate_load_state(str(step / "accelerator")),
                                   trained, expected))
    if opts.stock:
        say(f"  timing stock DCP's plan exchange (deadline {opts.stock_deadline_s:.0f} s)")
        checks.append(stock_plan_exchange(trained, root / "stock", opts.stock_deadline_s))
    return checks


def _build(job, opts):
    """Every rank: the trained model, or None, and the check saying which."""
    from .checks import timed
    from .roundtrip import TrainedModel

    built = []

    def work():
        built.append(TrainedModel(job, opts.width, opts.layers, opts.steps, opts.offload))
        return True, _model_line(built[0]), {"parameters": built[0].parameters}
    check = timed("model", work)
    return (built[0] if check.ok else None), check


def _model_line(trained) -> str:
    return (f"MOVA-shaped FSDP2 model, {trained.parameters / 1e6:.1f} M parameters, checkpoint about "
            f"{trained.checkpoint_bytes() / 1e6:.0f} MB, trained")


def _report(job, opts, root: Path, checks: list[Check], trained) -> dict:
    from ..fix.compat import installed_versions

    torch_v, accelerate_v = installed_versions()
    import ckptdoctor

    return {"ckptdoctor": str(Path(ckptdoctor.__file__).parent), "world_size": job.world_size, "backend": job.backend,
            "device": job.device, "torch": torch_v, "accelerate": accelerate_v, "dir": str(root),
            "job_ranks": opts.job_ranks or job.world_size,
            "parameters": trained.parameters if trained else None,
            "checks": [dataclasses.asdict(c) | {"verdict": c.verdict} for c in checks],
            "passed": all(c.ok for c in checks)}


def format_report(report: dict) -> str:
    lines = [f"ckptdoctor selftest: {report['world_size']} rank(s), {report['backend']} on {report['device']}, "
             f"torch {report['torch']}, accelerate {report['accelerate']}"]
    for c in report["checks"]:
        lines.append(f"  {c['verdict']}  {c['name']:<22} {c['seconds']:8.2f} s  {c['detail']}")
    failed = [c["name"] for c in report["checks"] if c["ok"] is False]
    skipped = [c["name"] for c in report["checks"] if c["ok"] is None]
    lines.append("RESULT: PASS, every check passed" if report["passed"] else
                 f"RESULT: FAIL: {len(failed)} failed ({', '.join(failed)})"
                 + (f", {len(skipped)} skipped because of it" if skipped else ""))
    return "\n".join(lines)


def write_json(report: dict, path: str) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(report, indent=1))


def _skipped(name: str, why: str = "the directory is not writable on every rank") -> Check:
    return Check(name, None, 0.0, f"skipped: {why}")


def _gather(group, value) -> list:
    import torch.distributed as dist

    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, value, group=group)
    return out


def _broadcast(group, value):
    import torch.distributed as dist

    box = [value]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
    return box[0]

"""How long a save stops training: stock save_state, the fix synchronous, the fix async, against
the floor of a plain host copy of the same bytes, all in one run (issue 31).

    .venv/user/bin/python benchmarks/async_save.py                  # 8 ranks, 4 saves per kind
    .venv/user/bin/python benchmarks/async_save.py --width 512 --saves 2 --out runs/bench-async

Three real 8-rank jobs of `ckptdoctor selftest`'s MOVA-shaped FSDP2 model with CPU offload (as
MOVA runs it), launched one after another; in each, every save is preceded by the floor measured
on the same rank with the same state:

  floor       a plain copy of this rank's state tensors (parameter shards, AdamW's moments) into
              host buffers allocated once before the first save
  stall       the time save_state blocks the training loop (the slowest rank's, per save): stock
              Accelerate, the fix synchronous, the fix async (CKPTDOCTOR_ASYNC's path)
  background  async only: from save_state's return to the save's publication on this rank
  steps       async only: `--steps` training steps right after save_state returned (the write in
              flight) against the same number of steps with nothing in flight, per save
  write floor sync only: a per-rank torch.save of the same tensors to the same file system, fsynced

Prints a table and writes OUT/async_save.json (raw per-save, per-rank values and the ratios).
On this machine 8 ranks share 2 cores: a background write competes with training for them, which
a node with a core per rank does not; ratios here are an upper bound for that reason.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

KINDS = ("stock", "fix", "async")


def rank_job(out: Path, kind: str, width: int, layers: int, saves: int, steps: int) -> None:
    """One rank of one job: `saves` saves of `kind`, each preceded by the floor."""
    import torch
    import torch.distributed as dist

    from ckptdoctor.selftest.backend import start
    from ckptdoctor.selftest.model import batch
    from ckptdoctor.selftest.roundtrip import TrainedModel

    job = start("gloo", 1800.0)
    trained = TrainedModel(job, width, layers, steps=1, offload=True)
    ckpt = None
    if kind != "stock":
        from ckptdoctor import ScalableCheckpointing
        ckpt = ScalableCheckpointing(trained.accelerator, async_save=kind == "async")

    def train(n: int, seed: int) -> float:
        started = time.monotonic()
        for i in range(n):
            video, audio = batch(width, seed=seed + i, device=job.torch_device())
            trained.accelerator.backward(trained.model(video, audio))
            trained.optimizer.step()
            trained.optimizer.zero_grad()
        return time.monotonic() - started

    def tensors():
        found = [p.to_local() if hasattr(p, "to_local") else p for p in trained.model.parameters()]
        for state in trained.optimizer.optimizer.state.values():
            found += [v.to_local() if hasattr(v, "to_local") else v for v in state.values() if torch.is_tensor(v)]
        return [t.detach() for t in found]

    host = [torch.empty_like(t, device="cpu") for t in tensors()]  # the floor's buffers, allocated once
    rows = []
    for i in range(saves):
        dist.barrier()
        started = time.monotonic()
        for buffer, tensor in zip(host, tensors()):
            buffer.copy_(tensor)
        row = {"save": i, "floor_s": time.monotonic() - started, "bytes": sum(t.numel() * t.element_size()
                                                                                for t in host)}
        dist.barrier()
        step_dir = out / kind / f"step-{i}"
        started = time.monotonic()
        if kind == "stock":
            trained.accelerator.save_state(str(step_dir))
        else:
            ckpt.save_state(step_dir)
        row["stall_s"] = time.monotonic() - started
        if ckpt is not None:
            row["phases_at_return_s"] = dict(ckpt.last_operation.phases)  # where the stall went
        if kind == "async":
            row["steps_in_flight_s"] = train(steps, 100 * i)
            row["in_flight_after_steps"] = ckpt._background.in_flight()
            ckpt.wait()
            row["background_s"] = ckpt.last_operation.ended - started - row["stall_s"]
            dist.barrier()
            row["steps_alone_s"] = train(steps, 100 * i + 50)
        if kind == "fix":
            dist.barrier()
            started = time.monotonic()
            path = out / kind / f"floor-{i}" / f"rank{job.rank}.pt"
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.save(host, path)
            with open(path, "rb+") as f:
                os.fsync(f.fileno())
            row["write_floor_s"] = time.monotonic() - started
        train(1, 1000 + i)  # the state changes between saves, as in training
        rows.append(row)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, rows)
    if job.rank == 0:
        (out / f"{kind}.json").write_text(json.dumps(everyone))
    if ckpt is not None:
        ckpt.wait()
    dist.destroy_process_group()


def slowest(per_rank: list[list[dict]], key: str) -> list[float]:
    """Per save, the slowest rank's value (a step is as slow as its slowest rank)."""
    return [max(rank[i][key] for rank in per_rank) for i in range(len(per_rank[0]))]


def summarize(out: Path) -> dict:
    runs = {kind: json.loads((out / f"{kind}.json").read_text()) for kind in KINDS}
    floor = statistics.median(slowest(runs["async"], "floor_s") + slowest(runs["fix"], "floor_s")
                              + slowest(runs["stock"], "floor_s"))
    stalls = {kind: statistics.median(slowest(runs[kind], "stall_s")) for kind in KINDS}
    in_flight = statistics.median(slowest(runs["async"], "steps_in_flight_s"))
    alone = statistics.median(slowest(runs["async"], "steps_alone_s"))
    return {
        "ranks": len(runs["async"]), "saves_per_kind": len(runs["async"][0]),
        "bytes_per_rank": runs["async"][0][0]["bytes"],
        "floor_s": floor, "stall_s": stalls,
        "stall_over_floor": {kind: stalls[kind] / floor for kind in KINDS},
        "async_background_s": statistics.median(slowest(runs["async"], "background_s")),
        "steps_in_flight_s": in_flight, "steps_alone_s": alone, "steps_ratio": in_flight / alone,
        "still_in_flight_after_the_steps": sum(r["in_flight_after_steps"] for rank in runs["async"] for r in rank),
        "write_floor_s": statistics.median(slowest(runs["fix"], "write_floor_s")),
        "fix_sync_over_write_floor": stalls["fix"] / statistics.median(slowest(runs["fix"], "write_floor_s")),
        "raw": runs,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--saves", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3, help="training steps timed with and without a save in flight")
    parser.add_argument("--out", default="runs/bench-async")
    parser.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS),
                        help="run only these jobs (the summary needs all three in OUT)")
    parser.add_argument("--rank-job", nargs=6, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_job:
        out, kind, width, layers, saves, steps = args.rank_job
        rank_job(Path(out), kind, int(width), int(layers), int(saves), int(steps))
        return 0
    from ckptdoctor.repro.launcher import launch

    out = Path(args.out).absolute()
    out.mkdir(parents=True, exist_ok=True)
    for kind in args.kinds:
        print(f"{kind}: {args.ranks} ranks, {args.saves} saves ...", flush=True)
        result = launch([__file__, "--rank-job", str(out), kind, str(args.width), str(args.layers), str(args.saves),
                         str(args.steps)], args.ranks, out / f"{kind}.log", timeout_s=3600,
                        env={"CKPTDOCTOR_LOG_LEVEL": "WARNING"})
        if result.returncodes != [0] * args.ranks:
            print(f"{kind} failed: {result.returncodes}; see {out / f'{kind}.log'}", file=sys.stderr)
            return 1
    summary = summarize(out)
    (out / "async_save.json").write_text(json.dumps(summary, indent=1))
    print(f"{summary['ranks']} ranks, {summary['bytes_per_rank'] / 1e6:.1f} MB of state per rank, "
          f"medians of {summary['saves_per_kind']} saves (slowest rank each)")
    print(f"  floor (plain host copy)         {summary['floor_s']:.3f} s")
    for kind in KINDS:
        print(f"  stall, {kind:<6}                  {summary['stall_s'][kind]:.3f} s  "
              f"= {summary['stall_over_floor'][kind]:.2f} x floor")
    print(f"  async: background until published {summary['async_background_s']:.3f} s")
    print(f"  async: {args.steps} steps with the save in flight {summary['steps_in_flight_s']:.3f} s, alone "
          f"{summary['steps_alone_s']:.3f} s = {summary['steps_ratio']:.2f} x")
    print(f"  fix sync vs per-rank torch.save   {summary['fix_sync_over_write_floor']:.2f} x "
          f"(write floor {summary['write_floor_s']:.3f} s)")
    print(f"raw: {out / 'async_save.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

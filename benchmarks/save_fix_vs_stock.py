"""8-rank end-to-end save time, the fix vs stock, in the same run (the issue asks ratio <= 1.1).

    .venv/user/bin/python benchmarks/save_fix_vs_stock.py --rounds 3 --mode sft

Alternates real 8-process training jobs under a long deadline, one saving with Accelerate's
stock path and one with ScalableCheckpointing. The save time is rank 0's span from the model
save's dcp.save start to the optimizer save's dcp.save end (torch's own DCP events); the fixed
job's extra round-trip load is not counted. Reports medians and their ratio.
"""

import argparse
import statistics
from pathlib import Path

from ckptdoctor.repro.reproduce import ReproOptions, run_job


def save_span(outcome) -> float:
    saves = [e for e in outcome.events if e.rank == 0 and e.step == "save"]
    start = min(e.time_s for e in saves if e.event == "start")
    end = max(e.time_s for e in saves if e.event == "end")
    return end - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--mode", choices=("sft", "lora"), default="sft")
    parser.add_argument("--out", default="runs/bench-fix")
    args = parser.parse_args()
    spans = {"stock": [], "fix": []}
    for i in range(args.rounds):
        for name in (("stock", "fix") if i % 2 == 0 else ("fix", "stock")):
            opts = ReproOptions(mode=args.mode, trainer="lookalike", output_dir=Path(args.out))
            outcome = run_job(opts, f"{name}{i}", 1800.0, progress=lambda _: None, fix=name == "fix")
            if any(r.get("status") != "ok" for r in outcome.ranks):
                raise SystemExit(f"{name} job failed: see {outcome.log_path}")
            spans[name].append(save_span(outcome))
            print(f"round {i + 1}/{args.rounds} {name}: save {spans[name][-1]:.2f} s", flush=True)
    stock, fix = statistics.median(spans["stock"]), statistics.median(spans["fix"])
    print(f"median save: stock {stock:.2f} s, fix {fix:.2f} s, ratio fix/stock {fix / stock:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

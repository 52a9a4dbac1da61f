"""How far `check` and `simulate`'s extrapolation is from a direct measurement at N=256.

    .venv/user/bin/python benchmarks/extrapolation_error.py --ranks 256 --json docs/evidence/extrapolation_n256.json

Runs, in this interpreter (its torch), MOVA's real shapes, FSDP over all N:
* the small-N jobs `check` (every plan materialised up to N=16) and the documents (up to
  N=32) extrapolate from, with torch's validation timed on a sample (one tensor per shape);
* the same save at N with every rank's plan materialised and torch's validation run on
  every tensor: the direct measurement (its planning counts that validation, not the sample).
Then prints, per save and planner, rank 0's planning and finish from each basis beside the
direct one, and their ratio. The jobs run one at a time: the optimizer save at N=256 holds
about 12 GB.
"""

import argparse
import json
import sys
import time

from ckptdoctor.check.jobs import HERE, run_job
from ckptdoctor.check.save_model import ScalingOptions, measurement_jobs, build_records
from ckptdoctor.check.layout import Layout

BASES = {"check (N<=16)": 16, "documents (N<=32)": 32}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=256)
    parser.add_argument("--saves", default="model,optimizer")
    parser.add_argument("--json", metavar="PATH", help="write every raw job result and the comparison here")
    args = parser.parse_args()
    saves = tuple(args.saves.split(","))
    n, fsdp = args.ranks, Layout.parse("fsdp")

    def options(max_measured):
        return ScalingOptions(ranks=[n], layouts=[fsdp], stacks=[HERE], saves=saves, max_measured=max_measured,
                              max_validated=n, parallel=1)

    jobs = {key: job for basis in (*BASES.values(), n) for key, _, job in measurement_jobs(options(basis))}
    for save in saves:  # the direct stock job validates every tensor, not a sample
        jobs[("coordinator", HERE, "fsdp", save, n, "stock")]["validation_sample"] = None
    results = {}
    for done, (key, job) in enumerate(sorted(jobs.items(), key=lambda kv: kv[0][4]), 1):
        start = time.monotonic()
        results[key] = run_job(sys.executable, job)
        print(f"[{done}/{len(jobs)}] {key[5]} {key[3]} save, {key[0]} at N={key[4]}: "
              f"{time.monotonic() - start:.0f} s", flush=True)

    def records(max_measured):
        kept = {k: v for k, v in results.items() if k[0] != "coordinator" or k[4] <= max_measured}
        return {(r["save"], r["planner"]): r for r in build_records(options(max_measured), kept)}

    direct = records(n)
    by_basis = {name: records(m) for name, m in BASES.items()}
    comparison = []
    for (save, planner), measured in direct.items():
        full_validate = results[("coordinator", HERE, "fsdp", save, n, "stock")]["phase_s"]["validate"] \
            if planner == "stock" else None
        planning = measured["coordinator_s"]
        if full_validate is not None:  # the direct figure: torch's validation of every tensor, not the sample
            planning += full_validate - measured["phase_s"]["validate"]
        row = {"save": save, "planner": planner, "ranks": n, "torch": measured["torch"],
               "measured": {"planning_s": planning, "finish_s": measured["finish_s"],
                            "phase_s": measured["phase_s"], "validate_all_tensors_s": full_validate},
               "extrapolated": {name: {"planning_s": r[(save, planner)]["coordinator_s"],
                                       "finish_s": r[(save, planner)]["finish_s"],
                                       "phase_s": r[(save, planner)]["phase_s"]} for name, r in by_basis.items()}}
        comparison.append(row)
    print(format_comparison(comparison))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"comparison": comparison, "raw": [{"key": list(k), "result": v} for k, v in results.items()]},
                      f, indent=1)
    return 0


def format_comparison(rows) -> str:
    lines = [f"rank 0 at N={rows[0]['ranks']}, torch {rows[0]['torch']}, fsdp: extrapolated / measured directly",
             f"{'save':>9} {'planner':>7} {'what':>9} {'measured':>10}  " +
             "  ".join(f"{name:>26}" for name in BASES)]
    for row in rows:
        for what in ("planning", "finish"):
            measured = row["measured"][f"{what}_s"]
            cells = [f"{e[f'{what}_s']:8.2f} s ({e[f'{what}_s'] / measured:4.2f}x)" for e in row["extrapolated"].values()]
            lines.append(f"{row['save']:>9} {row['planner']:>7} {what:>9} {measured:8.2f} s  " +
                         "  ".join(f"{c:>26}" for c in cells))
        if row["measured"]["validate_all_tensors_s"] is not None:
            sampled = row["measured"]["phase_s"]["validate"]
            full = row["measured"]["validate_all_tensors_s"]
            lines.append(f"{'':>9} {'':>7} validate: on a sample, scaled by count {sampled:.2f} s; every tensor "
                         f"{full:.2f} s ({sampled / full:.2f}x)" if full else "validate: every tensor 0 s")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())

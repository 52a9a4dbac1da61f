"""Run `ckptdoctor repro` several times in a row and tabulate the outcomes.

    .venv/user/bin/python benchmarks/repro_determinism.py --runs 10 --mode sft

Each run is a full calibration + reproduction (about 2 minutes on 2 cores). Prints one
row per run and a final count; writes the rows as JSON next to the runs.
"""

import argparse
import json
import subprocess
import sys
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--mode", choices=("sft", "lora"), default="sft")
    parser.add_argument("--out", default="runs/determinism")
    args = parser.parse_args()
    out = Path(args.out) / args.mode
    rows = []
    for i in range(args.runs):
        report_path = out / f"run{i}.json"
        proc = subprocess.run([sys.executable, "-m", "ckptdoctor.cli", "repro", "--mode", args.mode,
                               "--out", str(out / f"run{i}"), "--json", str(report_path)],
                              capture_output=True, text=True)
        report = json.loads(report_path.read_text()) if report_path.exists() else {}
        row = {"run": i, "exit": proc.returncode, "reproduced": report.get("reproduced"),
               "failed_call": report.get("failed_call"), "failed_phase": report.get("failed_phase"),
               "deadline_ms": report.get("deadline_ms"), "bounds_s": report.get("deadline_bounds_s")}
        rows.append(row)
        print(json.dumps(row), flush=True)
    (out / "summary.json").write_text(json.dumps(rows, indent=1))
    same = sum(r["reproduced"] is True for r in rows)
    print(f"{same}/{len(rows)} runs reproduced ({args.mode})")
    return 0 if same == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())

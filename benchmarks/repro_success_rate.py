"""How often does the reproduction reproduce? Run it many times, record every raw outcome.

    .venv/user/bin/python benchmarks/repro_success_rate.py --runs 5 [--mode lora] [--stack newest]
        [--trainer auto|mova|lookalike] [--hog] [--fresh-clone] [--out docs/evidence/repro_success.jsonl]

Each run is a whole `ckptdoctor repro` (calibration, then up to 3 attempts), as a newcomer runs
it: `--fresh-clone` clones this repository's HEAD beside it and runs `scripts/repro` there from
nothing, the install included (the clone and its environment are deleted afterwards);
`--hog` keeps one unrelated CPU-bound process (`while 1: pass`) running beside the run.
One JSON line per run is appended to --out: the verdict, every attempt's deadline and outcome,
the margins the deadline was chosen with, the wall time. Not a test: it measures; the summary
line counts what reproduced.
"""

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_once(args, index: int, scratch: Path) -> dict:
    report_path = scratch / f"run{index}.json"
    hog = subprocess.Popen([sys.executable, "-c", "while 1: pass"]) if args.hog else None
    start = time.time()
    try:
        if args.fresh_clone:
            clone = REPO.parent / f"ckptdoctor-fresh-clone-{index}"
            shutil.rmtree(clone, ignore_errors=True)
            subprocess.run(["git", "clone", "--quiet", "--no-local", str(REPO), str(clone)], check=True)
            if not (clone / "scripts" / "repro").is_file():  # judged by its effect, not git's exit status
                raise RuntimeError(f"git clone of {REPO} left no scripts/repro in {clone}")
            command = [str(clone / "scripts" / "repro"), "--json", str(report_path), "--out", str(scratch / f"run{index}")]
        else:
            clone = None
            command = [str(REPO / ".venv" / args.stack / "bin" / "ckptdoctor"), "repro", "--json", str(report_path),
                       "--out", str(scratch / f"run{index}")]
        command += ["--mode", args.mode, "--trainer", args.trainer]
        proc = subprocess.run(command, capture_output=True, text=True)
    finally:
        if hog is not None:
            hog.kill()
    report = json.loads(report_path.read_text()) if report_path.exists() else {}
    if clone is not None:
        shutil.rmtree(clone, ignore_errors=True)  # ~7 GB of environment: the disk is shared with CI
    condition = "fresh-clone" if args.fresh_clone else ("cpu-hog" if args.hog else "plain")
    return {"condition": condition, "stack": "user" if args.fresh_clone else args.stack,
            "torch": report.get("torch"), "accelerate": report.get("accelerate"), "mode": args.mode,
            "trainer": report.get("trainer", args.trainer), "exit": proc.returncode,
            "reproduced": report.get("reproduced"), "not_separable": report.get("not_separable"),
            "attempts": report.get("attempts"), "margins": report.get("margins"),
            "failed_call": report.get("failed_call"), "failed_phase": report.get("failed_phase"),
            "wall_s": round(time.time() - start), "at": time.strftime("%Y-%m-%d %H:%M:%S"),
            "stderr_tail": proc.stderr.strip().splitlines()[-1:] if proc.returncode else []}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--mode", choices=("sft", "lora"), default="sft")
    parser.add_argument("--stack", choices=("user", "newest"), default="user")
    parser.add_argument("--trainer", choices=("auto", "mova", "lookalike"), default="auto")
    parser.add_argument("--hog", action="store_true", help="one unrelated CPU-bound process beside each run")
    parser.add_argument("--fresh-clone", action="store_true", help="clone HEAD and run scripts/repro there, install included")
    parser.add_argument("--out", default=str(REPO / "docs" / "evidence" / "repro_success.jsonl"))
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="ckptdoctor-success-"))
    rows = []
    for index in range(args.runs):
        row = run_once(args, index, scratch)
        rows.append(row)
        with open(args.out, "a") as f:
            f.write(json.dumps(row) + "\n")
        print(json.dumps(row), flush=True)
    shutil.rmtree(scratch, ignore_errors=True)
    reproduced = sum(r["reproduced"] is True for r in rows)
    print(f"{reproduced}/{len(rows)} reproduced ({rows[0]['condition']}, {args.stack}, {args.mode}, {rows[0]['trainer']})")
    return 0 if reproduced == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())

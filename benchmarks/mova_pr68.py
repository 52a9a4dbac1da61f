"""MOVA PR #68's idea, measured: does the reproduction still time out with it applied?

    .venv/user/bin/python benchmarks/mova_pr68.py --pr-diff PR68.diff [--out docs/evidence/mova_pr68.txt]

PR #68 (OpenMOSS/MOVA, open) saves per-rank optimizer and scheduler files under FSDP. Its diff is
not part of this repository: pass it (e.g. `git diff <merge-base> refs/pull/68/head` in a clone of
MOVA). The script copies the MOVA extract, applies the diff (checked by its effect on the files), and
runs the same scaled-deadline
reproduction as `ckptdoctor repro --trainer mova` on that code: calibration on the PR's own code,
then up to three attempts. Prints the verdict and where it failed.
"""

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from ckptdoctor.repro.mova.job import Extract
from ckptdoctor.repro.patching import PatchNotApplied, apply_diff
from ckptdoctor.repro.reproduce import MovaTrainer, ReproOptions, format_report, reproduce


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pr-diff", required=True, help="PR #68's diff against MOVA")
    parser.add_argument("--mode", choices=("sft", "lora"), default="sft")
    parser.add_argument("--out", help="append the summary here")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="ckptdoctor-pr68-"))
    code = Extract.find().copy_to(work / "mova-pr68", integration=None)
    try:  # applied when every file the diff names changed, not because git exited 0
        apply_diff(code, Path(args.pr_diff))
    except PatchNotApplied as problem:
        print(f"the diff does not apply to the extract: {problem}")
        return 2
    opts = ReproOptions(trainer="mova", mode=args.mode, output_dir=work / "runs")
    trainer = MovaTrainer(opts)
    trainer.copies[False] = code  # run the PR's code where the reproduction runs MOVA's own
    report = reproduce(opts, progress=print, trainer=trainer)
    text = format_report(report)
    print(text)
    summary = {"when": time.strftime("%Y-%m-%d %H:%M"), "mode": args.mode, "pr68_applied": True,
               "reproduced": report["reproduced"], "failed_call": report["failed_call"],
               "failed_phase": report["failed_phase"], "deadline_ms": report["deadline_ms"],
               "frames": [loc for loc in report["frame_locations"] if "mova" in loc or "accelerate_train" in loc]}
    if args.out:
        with open(args.out, "a") as f:
            f.write(f"# benchmarks/mova_pr68.py --mode {args.mode}\n{json.dumps(summary)}\n{text}\n\n")
    return 0 if report["reproduced"] else 1


if __name__ == "__main__":
    sys.exit(main())

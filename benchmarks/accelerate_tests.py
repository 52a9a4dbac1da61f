"""Accelerate's own tests of save_state/load_state, run stock and with the fix, in one report.

    python benchmarks/accelerate_tests.py [--stack user] [--accelerate 1.14.0]
        [--files tests/test_state_checkpointing.py,...] [--out docs/evidence/accelerate_tests_<stack>.txt]

A peer's suite finds what our own shapes do not. For the Accelerate installed in `.venv/<stack>`,
this downloads that release's sdist from the registry (sha256 pinned; nothing of it is committed),
then runs the chosen test files with pytest in the stack's interpreter four times: stock and with
`import ckptdoctor.auto` (install after every `Accelerator.prepare`), each without a process group
and inside a one-rank gloo group (tests/support/accelerate_suite.py). It reports the counts per
run and the tests that pass stock and not with the fix, the number that must be zero. CI runs the
checkpointing file alone (tests/acceptance/test_accelerate_own_tests.py); this adds
`tests/test_accelerator.py`, whose save/load tests (hooks, pickling, stateful data loaders) are
part of the API a drop-in must keep. `--accelerate V` runs another release with the stack's torch:
V is installed without dependencies into the scratch directory, ahead of the stack's own on the
runs' path (each run records the version it imported; the report says it). The scratch directory
is removed at the end.
"""

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
from support import accelerate_suite as suite  # noqa: E402

DEFAULT_FILES = "tests/test_state_checkpointing.py,tests/test_accelerator.py"


def counts(found: dict) -> str:
    return ", ".join(f"{sum(1 for o, _ in found.values() if o == what)} {what}" for what in ("passed", "failed",
                                                                                           "skipped"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stack", default="user", help="the pinned stack whose interpreter runs the tests")
    parser.add_argument("--files", default=DEFAULT_FILES, help="Accelerate test files, comma-separated")
    parser.add_argument("--accelerate", metavar="V", help="another Accelerate release to run with the stack's torch "
                        "(default: the stack's own)")
    parser.add_argument("--out", type=Path, help="the report (default docs/evidence/accelerate_tests_<stack>.txt, "
                        "with --accelerate: accelerate_tests_<stack>_<V>.txt)")
    args = parser.parse_args()
    python = str(REPO / ".venv" / args.stack / "bin" / "python")
    if not Path(python).exists():
        sys.exit(f"no .venv/{args.stack}: run scripts/setup.sh {args.stack} first")
    version = args.accelerate or subprocess.run([python, "-c", "import accelerate; print(accelerate.__version__)"],
                                                capture_output=True, text=True, check=True).stdout.strip()
    suffix = f"_{args.accelerate}" if args.accelerate else ""
    out = args.out or REPO / "docs" / "evidence" / f"accelerate_tests_{args.stack}{suffix}.txt"
    files = args.files.split(",")
    scratch = Path(tempfile.mkdtemp(prefix="ckptdoctor-accelerate-tests-"))
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    flag = f" --accelerate {args.accelerate}" if args.accelerate else ""
    lines = [f"# python benchmarks/accelerate_tests.py --stack {args.stack}{flag} --files {args.files} (commit {commit})",
             f"accelerate {version}, sdist sha256 {suite.SDIST_SHA256.get(version, '?')}"]
    try:
        print(f"[1/5] accelerate {version}'s sdist from the registry into {scratch}", flush=True)
        source = suite.fetch(python, version, scratch)
        over = suite.overlay(python, version, scratch) if args.accelerate else None
        runs = {}
        for step, (fix, group) in enumerate([(False, False), (True, False), (False, True), (True, True)], start=2):
            name = f"{'ours ' if fix else 'stock'} {'one-rank gloo group' if group else 'no process group'}"
            print(f"[{step}/5] {name}", flush=True)
            started = time.monotonic()
            runs[fix, group] = suite.run(python, source, files, scratch, fix=fix, group=group, overlay=over)
            lines.append(f"{name:<36} {counts(runs[fix, group])} ({time.monotonic() - started:.0f} s)")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    imported = {(r.imported["accelerate"], r.imported["torch"]) for r in runs.values()}
    lines.insert(2, "imported by the runs: " + ", ".join(f"accelerate {a} + torch {t}" for a, t in sorted(imported)))
    for group in (False, True):
        lost = suite.regressions(runs[False, group], runs[True, group])
        lines.append(f"stock passed, ours did not ({'one-rank gloo group' if group else 'no process group'}): "
                     f"{len(lost)}")
        lines += [f"  {name}: {why}" for name, why in lost.items()]
    summary = len(lines)
    lines += ["", "stock/ours without a group, stock/ours in a one-rank group, test:"]
    lines += [f"{runs[False, False][n][0]:>7} {runs[True, False].get(n, ('missing',))[0]:>7} "
              f"{runs[False, True].get(n, ('missing',))[0]:>7} {runs[True, True].get(n, ('missing',))[0]:>7}  {n}"
              for n in sorted(runs[False, False])]
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines[:summary]))
    print(f"written: {out}")


if __name__ == "__main__":
    main()

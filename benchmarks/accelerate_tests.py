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
part of the API a drop-in must keep. The scratch directory is removed at the end.

`--accelerate V` runs another Accelerate release than the stack's, on the stack's torch: a scratch
venv whose own site-packages hold that release alone (pip, no dependencies) and that sees the
stack's packages and this checkout's `src` behind it (the releases between the two stacks CI
runs: 1.14.0 and 1.15.0, with torch 2.8.0).
"""

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
import venv
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
from support import accelerate_suite as suite  # noqa: E402

DEFAULT_FILES = "tests/test_state_checkpointing.py,tests/test_accelerator.py"


def counts(found: dict) -> str:
    return ", ".join(f"{sum(1 for o, _ in found.values() if o == what)} {what}" for what in ("passed", "failed",
                                                                                           "skipped"))


def overlay(stack_python: str, version: str, scratch: Path) -> str:
    """A venv holding accelerate `version` alone, with the stack's packages and this checkout's
    src behind it (a .pth); returns its interpreter."""
    root = scratch / f"accelerate-{version}"
    venv.create(root, with_pip=True)
    python = str(root / "bin" / "python")
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    stack_site = subprocess.run([stack_python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                check=True, capture_output=True, text=True).stdout.strip()
    Path(site, "stack.pth").write_text(f"{REPO / 'src'}\n{stack_site}\n")
    subprocess.run([python, "-m", "pip", "install", "--quiet", "--no-deps", "--no-compile", f"accelerate=={version}"],
                   check=True, env={**os.environ, **suite.PIP_ENV})
    got = subprocess.run([python, "-c", "import accelerate, ckptdoctor; print(accelerate.__version__, ckptdoctor.__file__)"],
                         check=True, capture_output=True, text=True).stdout.split()
    if got[0] != version or not got[1].startswith(str(REPO / "src")):  # judged by what the interpreter imports
        sys.exit(f"the overlay for accelerate {version} imports accelerate {got[0]} and ckptdoctor from {got[1]}")
    return python


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stack", default="user", help="the pinned stack whose interpreter runs the tests")
    parser.add_argument("--accelerate", help="another Accelerate release than the stack's, on the stack's torch")
    parser.add_argument("--files", default=DEFAULT_FILES, help="Accelerate test files, comma-separated")
    parser.add_argument("--out", type=Path, help="the report (default docs/evidence/accelerate_tests_<stack>.txt)")
    args = parser.parse_args()
    python = str(REPO / ".venv" / args.stack / "bin" / "python")
    if not Path(python).exists():
        sys.exit(f"no .venv/{args.stack}: run scripts/setup.sh {args.stack} first")
    scratch = Path(tempfile.mkdtemp(prefix="ckptdoctor-accelerate-tests-"))
    if args.accelerate:
        python = overlay(python, args.accelerate, scratch)
    version = subprocess.run([python, "-c", "import accelerate; print(accelerate.__version__)"], capture_output=True,
                             text=True, check=True).stdout.strip()
    name = args.stack + (f"_accelerate_{args.accelerate}" if args.accelerate else "")
    out = args.out or REPO / "docs" / "evidence" / f"accelerate_tests_{name}.txt"
    files = args.files.split(",")
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    torch_v = subprocess.run([python, "-c", "import torch; print(torch.__version__)"], capture_output=True,
                             text=True).stdout.strip()
    lines = [f"# python benchmarks/accelerate_tests.py --stack {args.stack}"
             f"{f' --accelerate {args.accelerate}' if args.accelerate else ''} --files {args.files} (commit {commit})",
             f"torch {torch_v}",
             f"accelerate {version}, sdist sha256 {suite.SDIST_SHA256.get(version, '?')}"]
    try:
        print(f"[1/5] accelerate {version}'s sdist from the registry into {scratch}", flush=True)
        source = suite.fetch(python, version, scratch)
        runs = {}
        for step, (fix, group) in enumerate([(False, False), (True, False), (False, True), (True, True)], start=2):
            name = f"{'ours ' if fix else 'stock'} {'one-rank gloo group' if group else 'no process group'}"
            print(f"[{step}/5] {name}", flush=True)
            started = time.monotonic()
            runs[fix, group] = suite.run(python, source, files, scratch, fix=fix, group=group)
            lines.append(f"{name:<36} {counts(runs[fix, group])} ({time.monotonic() - started:.0f} s)")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
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

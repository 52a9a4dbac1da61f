"""Accelerate's own tests of save_state/load_state, run stock and with `ckptdoctor.install` swapped in.

    python benchmarks/accelerate_tests.py [--stack user] [--files tests/test_state_checkpointing.py,...]
        [--out docs/evidence/accelerate_tests_<stack>.txt]

A peer's suite finds what our own shapes do not. Accelerate ships its tests in its source
distribution on the package registry; this command, for the Accelerate installed in
`.venv/<stack>`:

1. downloads that release's sdist (`pip download --no-binary`) into a scratch directory and takes
   its `tests/` (nothing of it is committed here), plus the test-only packages it imports
   (`parameterized`) into a scratch `--target` directory;
2. runs the chosen files with pytest twice in the stack's interpreter: stock, and with a plugin
   that imports `ckptdoctor.auto` (so `ckptdoctor.install(accelerator)` runs right after every
   `Accelerator.prepare(...)`, as a trainer adopting level 1 calls it), each with a JUnit report;
3. reports, per test, stock and ours, and counts: stock passed, ours passed, and the tests that
   pass stock and fail ours with their first error line (the number that must be zero).

One process per run, CPU only, no process group unless a test makes one: how Accelerate's tests
run on a machine without an accelerator. The scratch directory is removed at the end.
"""

import argparse
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_FILES = "tests/test_state_checkpointing.py,tests/test_accelerator.py"
TEST_ONLY_PACKAGES = ["parameterized"]
SWAP_PLUGIN = "import ckptdoctor.auto  # every Accelerator: ckptdoctor.install(self) after each prepare\n"


def run(cmd, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, **kwargs)


def installed_accelerate(python: str) -> str:
    out = run([python, "-c", "import accelerate, torch; print(accelerate.__version__, torch.__version__)"], check=True)
    return out.stdout.split()[0]


def fetch_tests(python: str, version: str, scratch: Path) -> Path:
    """The release's sdist from the registry, extracted; returns its root."""
    env = {"PIP_CONSTRAINT": "/dev/null", "PATH": "/usr/bin:/bin"}
    got = run([python, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:", "-d", str(scratch),
               f"accelerate=={version}"], env=env)
    sdists = list(scratch.glob(f"accelerate-{version}.tar.gz"))
    if not sdists:
        sys.exit(f"could not download accelerate {version}'s source distribution: {got.stderr.strip()[-500:]}")
    with tarfile.open(sdists[0]) as tar:
        tar.extractall(scratch, filter="data")
    extras = scratch / "site"
    got = run([python, "-m", "pip", "install", "--quiet", "--target", str(extras), *TEST_ONLY_PACKAGES], env=env)
    if got.returncode:
        sys.exit(f"could not install {TEST_ONLY_PACKAGES}: {got.stderr.strip()[-500:]}")
    return scratch / f"accelerate-{version}"


def outcomes(junit: Path) -> dict[str, tuple[str, str]]:
    """test id -> (passed | failed | skipped, first line of the failure)."""
    found = {}
    for case in ET.parse(junit).iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        failure = case.find("failure") if case.find("failure") is not None else case.find("error")
        if failure is not None:
            found[name] = ("failed", (failure.get("message") or "").strip().splitlines()[0][:200]
                           if failure.get("message") else "")
        elif case.find("skipped") is not None:
            found[name] = ("skipped", "")
        else:
            found[name] = ("passed", "")
    return found


def run_suite(python: str, source: Path, files: list[str], scratch: Path, swap: bool) -> tuple[dict, float]:
    junit = scratch / f"junit-{'ours' if swap else 'stock'}.xml"
    paths = [str(scratch / "site"), str(REPO / "src")]
    args = [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}", *files]
    if swap:
        (scratch / "plugin").mkdir(exist_ok=True)
        (scratch / "plugin" / "ckptdoctor_swap.py").write_text(SWAP_PLUGIN)
        paths.insert(0, str(scratch / "plugin"))
        args[3:3] = ["-p", "ckptdoctor_swap"]
    env = {"PYTHONPATH": ":".join(paths), "PATH": "/usr/bin:/bin", "HOME": str(scratch), "OMP_NUM_THREADS": "1",
           "CUDA_VISIBLE_DEVICES": ""}
    started = time.monotonic()
    run(args, cwd=source, env=env)
    if not junit.exists():
        sys.exit(f"pytest wrote no report for the {'swapped' if swap else 'stock'} run")
    return outcomes(junit), time.monotonic() - started


def report(version: str, stock: dict, ours: dict, walls: tuple[float, float]) -> list[str]:
    count = lambda found, what: sum(1 for outcome, _ in found.values() if outcome == what)  # noqa: E731
    regressions = [name for name, (outcome, _) in stock.items() if outcome == "passed" and ours.get(name, ("",))[0]
                   != "passed"]
    lines = [f"accelerate {version}: {len(stock)} tests",
             f"stock: {count(stock, 'passed')} passed, {count(stock, 'failed')} failed, {count(stock, 'skipped')} "
             f"skipped ({walls[0]:.0f} s)",
             f"ours:  {count(ours, 'passed')} passed, {count(ours, 'failed')} failed, {count(ours, 'skipped')} "
             f"skipped ({walls[1]:.0f} s)",
             f"stock passed, ours did not: {len(regressions)}"]
    lines += [f"  {name}: {ours.get(name, ('missing', ''))[1] or ours.get(name, ('missing',))[0]}" for name in regressions]
    lines.append("")
    lines += [f"{stock[name][0]:>7} {ours.get(name, ('missing',))[0]:>7}  {name}" for name in sorted(stock)]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stack", default="user", help="the pinned stack whose interpreter runs the tests")
    parser.add_argument("--files", default=DEFAULT_FILES, help="Accelerate test files, comma-separated")
    parser.add_argument("--out", type=Path, help="where to write the report (default docs/evidence/"
                                                 "accelerate_tests_<stack>.txt)")
    args = parser.parse_args()
    python = str(REPO / ".venv" / args.stack / "bin" / "python")
    if not Path(python).exists():
        sys.exit(f"no .venv/{args.stack}: run scripts/setup.sh {args.stack} first")
    version = installed_accelerate(python)
    out = args.out or REPO / "docs" / "evidence" / f"accelerate_tests_{args.stack}.txt"
    scratch = Path(tempfile.mkdtemp(prefix="ckptdoctor-accelerate-tests-"))
    try:
        print(f"[1/3] accelerate {version}'s tests from the registry into {scratch}", flush=True)
        source = fetch_tests(python, version, scratch)
        files = args.files.split(",")
        print(f"[2/3] stock: {', '.join(files)}", flush=True)
        stock, stock_s = run_suite(python, source, files, scratch, swap=False)
        print("[3/3] with ckptdoctor.install after every prepare", flush=True)
        ours, ours_s = run_suite(python, source, files, scratch, swap=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    lines = report(version, stock, ours, (stock_s, ours_s))
    header = f"# python benchmarks/accelerate_tests.py --stack {args.stack} --files {args.files}\n"
    out.write_text(header + "\n".join(lines) + "\n")
    print("\n".join(lines[:lines.index("")]))
    print(f"written: {out}")


if __name__ == "__main__":
    main()

"""torch's own DCP tests, stock and with ckptdoctor's four classes swapped in: a peer's suite.

    python benchmarks/torch_dcp_tests.py [--stack user] [--files test_planner.py,...] [--timeout 900]
        [--out docs/evidence/torch_dcp_tests_<stack>.txt]

Source: `test/distributed/checkpoint` of torch 2.6.0, from Debian's source package
(pytorch 2.6.0+dfsg-7, the orig tarball's sha256 pinned below), fetched at run time with
`apt-get source --download-only` into a scratch directory with its own package lists (the
machine's apt configuration is not touched); nothing of it is committed. No source of torch 2.8 or
newer is reachable here; the 2.6 tests run against the stack's torch (2.8.0 on the user stack).

Each file runs twice with pytest in the stack's interpreter, in a fresh scratch copy:
* stock, with one port to this machine: `skip_if_lt_x_gpu` is made a no-op, so a test that needs
  a GPU count only for speed runs on CPU (DTensorTestBase picks gloo and "cpu" there by itself);
  a test that really needs CUDA then fails stock and is out of the comparison;
* swap: the same, plus `ScalableSavePlanner`, `ScalableLoadPlanner`, `ScalableFileSystemWriter`
  and `ScalableFileSystemReader` put in place of torch's `DefaultSavePlanner`, `DefaultLoadPlanner`,
  `FileSystemWriter` and `FileSystemReader` in every module that names them, so that `dcp.save`/
  `dcp.load` with no planner or storage given, and a test that constructs the stock class by name,
  get ours.
Both are applied by a `sitecustomize` module on the runs' PYTHONPATH, so the ranks torch's test
bases spawn (fresh interpreters) get them too. A test that passes stock and fails swapped is run
again, alone, in both modes (flaky tests: counted only if it fails again while stock passes).
The report: per file, stock passed, swap passed, stock-pass/swap-fail (the goal: 0), the run's time,
and how often our classes were used in the swap run. A file whose swap run never used them compared
nothing: its passes are vacuous here (e.g. a test whose world size is the CUDA device count, 0 on
CPU, so that its body never runs) or test another API (state_dict utilities without DCP I/O).
"""

import argparse
import collections
import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE, VERSION = "pytorch", "2.6.0+dfsg-7"
ORIG = "pytorch_2.6.0+dfsg.orig.tar.xz"
ORIG_SHA256 = "099a9601bc40d67656e75735c44abedb0fbe92d08817852ab7472eebb7e6ddff"
SOURCES = "deb-src http://deb.debian.org/debian trixie main\n"
TESTS = "test/distributed/checkpoint/"
TEST_ONLY_PACKAGES = ["expecttest==0.3.0"]  # torch.testing._internal imports it

SITECUSTOMIZE = '''\
import os

if os.environ.get("CKPTDOCTOR_DCP_TESTS"):
    import torch.testing._internal.common_distributed as common_distributed

    def skip_if_lt_x_gpu(x):  # the CPU port: a GPU count only for speed
        return lambda func: func
    common_distributed.skip_if_lt_x_gpu = skip_if_lt_x_gpu

if os.environ.get("CKPTDOCTOR_DCP_TESTS") == "swap":
    import importlib
    from ckptdoctor.fix.load_planner import ScalableLoadPlanner
    from ckptdoctor.fix.planner import ScalableSavePlanner
    from ckptdoctor.fix.storage import ScalableFileSystemReader, ScalableFileSystemWriter

    ours = {"DefaultSavePlanner": ScalableSavePlanner, "DefaultLoadPlanner": ScalableLoadPlanner,
            "FileSystemWriter": ScalableFileSystemWriter, "FileSystemReader": ScalableFileSystemReader}
    for name in ("", ".default_planner", ".filesystem", "._storage_utils", ".state_dict_saver",
                 ".state_dict_loader", ".optimizer", ".format_utils"):
        try:
            module = importlib.import_module("torch.distributed.checkpoint" + name)
        except ImportError:
            continue
        for stock, replacement in ours.items():
            if hasattr(module, stock):
                setattr(module, stock, replacement)

    def traced(cls, method):  # one line per use, per process: the report counts them (the swap was live)
        original = getattr(cls, method)

        def wrapper(self, *args, **kwargs):
            with open(os.path.join(os.environ["CKPTDOCTOR_DCP_TRACE"], str(os.getpid())), "a") as f:
                f.write(cls.__name__ + "\\n")
            return original(self, *args, **kwargs)
        setattr(cls, method, wrapper)
    for cls, method in ((ScalableSavePlanner, "create_local_plan"), (ScalableLoadPlanner, "create_local_plan"),
                        (ScalableFileSystemWriter, "write_data"), (ScalableFileSystemReader, "read_data")):
        traced(cls, method)
'''


def fetch(scratch: Path) -> Path:
    """Debian's source of torch 2.6.0, its sha256 checked; the DCP tests extracted. Returns the source root."""
    apt = scratch / "apt"
    (apt / "lists" / "partial").mkdir(parents=True)
    (apt / "sources.list").write_text(SOURCES)
    options = ["-o", f"Dir::Etc::SourceList={apt / 'sources.list'}", "-o", "Dir::Etc::SourceParts=/dev/null",
               "-o", f"Dir::State::Lists={apt / 'lists'}"]
    subprocess.run(["apt-get", *options, "update"], check=True, capture_output=True)
    subprocess.run(["apt-get", *options, "source", "--download-only", f"{PACKAGE}={VERSION}"], cwd=apt, check=True,
                   capture_output=True)
    orig = apt / ORIG
    digest = hashlib.sha256(orig.read_bytes()).hexdigest()
    if digest != ORIG_SHA256:
        raise SystemExit(f"{ORIG} has sha256 {digest}, pinned {ORIG_SHA256}")
    with tarfile.open(orig) as tar:
        members = [m for m in tar.getmembers() if TESTS in m.name]
        tar.extractall(scratch / "src", members=members, filter="data")
    return next((scratch / "src").iterdir())


def outcomes(junit: Path) -> dict[str, str]:
    found = {}
    for case in ET.parse(junit).iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        if case.find("failure") is not None or case.find("error") is not None:
            found[name] = "failed"
        elif case.find("skipped") is not None:
            found[name] = "skipped"
        else:
            found[name] = "passed"
    return found


def run(python: str, root: Path, target: str, mode: str, scratch: Path, timeout: float, tag: str) -> tuple[dict, dict]:
    """pytest on `target` (a file, or a node id) in `mode` ("stock" or "swap"): (test -> outcome,
    how many times each of our classes was used, from every process of the run)."""
    junit, trace = scratch / f"junit-{tag}-{mode}.xml", scratch / f"trace-{tag}-{mode}"
    trace.mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(scratch / "site"), str(REPO / "src")]),
           "CKPTDOCTOR_DCP_TESTS": mode, "CKPTDOCTOR_DCP_TRACE": str(trace), "OMP_NUM_THREADS": "1",
           "CUDA_VISIBLE_DEVICES": ""}
    try:
        subprocess.run([python, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}", target],
                       cwd=root / "test", env=env, capture_output=True, timeout=timeout)
        found = outcomes(junit) if junit.exists() else {"<no report>": "failed"}
    except subprocess.TimeoutExpired:
        found = {"<timeout>": "failed"}
    used = collections.Counter(line for f in trace.iterdir() for line in f.read_text().split())
    return found, dict(used)


def node_id(name: str, file: str) -> str:
    """pytest's node id of a junit test name (classname is the dotted path, then the class)."""
    classname, test = name.split("::")
    cls = classname.split(".")[-1]
    return f"{file}::{cls}::{test}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stack", default="user", help="the pinned stack whose interpreter runs the tests")
    parser.add_argument("--files", help="test files under test/distributed/checkpoint, comma-separated (default: all)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per file and mode (default 900)")
    parser.add_argument("--out", type=Path, help="the report (default docs/evidence/torch_dcp_tests_<stack>.txt)")
    args = parser.parse_args()
    python = str(REPO / ".venv" / args.stack / "bin" / "python")
    if not Path(python).exists():
        sys.exit(f"no .venv/{args.stack}: run scripts/setup.sh {args.stack} first")
    out = args.out or REPO / "docs" / "evidence" / f"torch_dcp_tests_{args.stack}.txt"
    scratch = Path(tempfile.mkdtemp(prefix="ckptdoctor-dcp-tests-"))
    started = time.monotonic()
    try:
        print(f"[fetch] Debian's {PACKAGE} {VERSION} source into {scratch}", flush=True)
        root = fetch(scratch)
        subprocess.run([python, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(scratch / "site"),
                        *TEST_ONLY_PACKAGES], check=True, env={**os.environ, "PIP_CONSTRAINT": "/dev/null"})
        (scratch / "site" / "sitecustomize.py").write_text(SITECUSTOMIZE)
        tests = root / TESTS
        files = args.files.split(",") if args.files else sorted(
            str(p.relative_to(tests)) for p in tests.rglob("test_*.py"))
        rows, lost_all = [], []
        for i, file in enumerate(files, 1):
            target = TESTS.removeprefix("test/") + file
            t0 = time.monotonic()
            stock, _ = run(python, root, target, "stock", scratch, args.timeout, f"{i}")
            swap, used = run(python, root, target, "swap", scratch, args.timeout, f"{i}")
            lost = sorted(n for n, o in stock.items() if o == "passed" and swap.get(n) != "passed")
            confirmed = []
            for name in lost:  # a flaky test is counted only if it fails again, alone, while stock passes
                node = node_id(name, target) if not name.startswith("<") else target
                again_stock, _ = run(python, root, node, "stock", scratch, args.timeout, f"{i}-{name}")
                again_swap, _ = run(python, root, node, "swap", scratch, args.timeout, f"{i}-{name}")
                if "passed" in again_stock.values() and "passed" not in again_swap.values():
                    confirmed.append(name)
            count = lambda found: sum(o == "passed" for o in found.values())  # noqa: E731
            row = (f"{file:<46} stock {count(stock):>3}/{len(stock):<3} swap {count(swap):>3}/{len(swap):<3} "
                   f"stock-pass/swap-fail {len(confirmed)} ({len(lost) - len(confirmed)} flaky) "
                   f"{time.monotonic() - t0:.0f} s; ours used: "
                   f"{', '.join(f'{k} {v}' for k, v in sorted(used.items())) or 'never'}")
            print(f"[{i}/{len(files)}] {row}", flush=True)
            rows.append(row)
            lost_all += [f"  {file}: {name}" for name in confirmed]
            write_report(out, args, rows, lost_all, started, done=i == len(files))  # after every file: a run
    finally:                                                                     # cut short still reports
        shutil.rmtree(scratch, ignore_errors=True)
    print(f"stock-pass/swap-fail in all: {len(lost_all)}")
    print(f"written: {out}")


def write_report(out: Path, args, rows: list[str], lost_all: list[str], started: float, done: bool) -> None:
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    lines = [f"# python benchmarks/torch_dcp_tests.py --stack {args.stack}"
             f"{' --files ' + args.files if args.files else ''} (commit {commit}); torch 2.6.0's DCP tests "
             f"(Debian {PACKAGE} {VERSION}) on this stack's torch, {time.monotonic() - started:.0f} s "
             f"{'in all' if done else 'so far (still running, or cut short)'}",
             "# file, stock passed/tests, swap passed/tests, stock-pass/swap-fail (confirmed alone), time, uses of our classes",
             "# (ours used: never = that file compared nothing: see the module docstring)",
             *rows, f"stock-pass/swap-fail in all: {len(lost_all)}", *lost_all]
    out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()

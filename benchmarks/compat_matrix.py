"""The fix's core tests on torch and Accelerate versions beyond the two pinned stacks.

    python benchmarks/compat_matrix.py [--torch 2.9.1,2.10.0] [--accelerate 1.15.0] \
        [--out docs/evidence/compat_matrix.jsonl]
    python benchmarks/compat_matrix.py --table docs/evidence/compat_matrix.jsonl   # the newest row per pair

For each (torch, accelerate) pair, one at a time: a scratch venv outside the checkout, the pair
and ckptdoctor (built from a scratch worktree of this checkout's HEAD, not editable) with its test extras, then the fix's
core tests with CKPTDOCTOR_ALLOW_UNCHECKED_VERSIONS=1 (the gate would refuse otherwise):

* tests/fix/test_equivalence.py  save/load round trips on random state dicts against stock DCP
* tests/fix/test_index.py, tests/fix/test_load.py, tests/fix/test_storage.py  the index and the reader
* tests/fix/test_checkpointing.py  ScalableCheckpointing on real gloo ranks (publish, faults, install)

The venv is deleted after each pair (each is several GB: the registry's torch is a CUDA build).
One JSON line per pair: versions, whether the install worked, pytest's counts per file, the
first failure's line, the wall time. A pair whose install fails is recorded as such.
"""

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CORE_TESTS = ["tests/fix/test_equivalence.py", "tests/fix/test_index.py", "tests/fix/test_load.py",
              "tests/fix/test_storage.py", "tests/fix/test_checkpointing.py"]
SUMMARY = re.compile(r"(\d+) (passed|failed|skipped|errors?)")


def run(cmd, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, **kwargs)


def one_pair(torch_v: str, accelerate_v: str, work: Path) -> dict:
    venv = work / "venv"
    py = venv / "bin" / "python"
    row = {"torch": torch_v, "accelerate": accelerate_v, "at": time.strftime("%Y-%m-%d %H:%M:%S")}
    start = time.time()
    run([sys.executable, "-m", "venv", str(venv)], check=True)
    source = work / "ckptdoctor"  # a copy: building in the checkout would leave build/ in it
    run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(source)], check=True)
    install = run([str(py), "-m", "pip", "install", "--no-cache-dir", "--quiet", f"torch=={torch_v}",
                   f"accelerate=={accelerate_v}", f"{source}[test]"],
                  env={**os.environ, "PIP_CONSTRAINT": os.devnull})  # the pair asked for, whatever pip's config caps
    run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(source)])
    row["install_s"] = round(time.time() - start)
    if install.returncode != 0:
        row.update(installed=False, error=(install.stderr.strip().splitlines() or ["?"])[-1][:300])
        return row
    versions = run([str(py), "-c", "import torch, accelerate; print(torch.__version__, accelerate.__version__)"])
    row.update(installed=True, imported=versions.stdout.strip())
    env = {**os.environ, "CKPTDOCTOR_ALLOW_UNCHECKED_VERSIONS": "1", "PYTHONDONTWRITEBYTECODE": "1"}
    row["tests"] = {}
    for test in CORE_TESTS:
        began = time.time()
        proc = run([str(py), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", test], cwd=REPO, env=env)
        last = (proc.stdout.strip().splitlines() or [""])[-1]
        counts = {kind.rstrip("s"): int(n) for n, kind in SUMMARY.findall(last)}
        failure = next((line for line in proc.stdout.splitlines() if line.startswith(("E ", "FAILED", "ERROR"))), None)
        row["tests"][test] = {"exit": proc.returncode, **counts, "first_failure": failure and failure[:300],
                              "wall_s": round(time.time() - began)}
    row["passed"] = all(t["exit"] == 0 for t in row["tests"].values())
    row["wall_s"] = round(time.time() - start)
    return row


def table(path: str) -> str:
    """A markdown table of the newest row per (torch, accelerate) pair in a JSON-lines file."""
    newest = {}
    for line in Path(path).read_text().splitlines():
        row = json.loads(line)
        newest[(row["torch"], row["accelerate"])] = row
    lines = ["| torch | Accelerate | run at | tests passed / failed | result |", "|---|---|---|---|---|"]
    for (torch_v, accelerate_v), row in sorted(newest.items(), key=lambda kv: [int(x) for x in kv[0][0].split(".")]):
        tests = row.get("tests", {}).values()
        passed, failed = sum(t.get("passed", 0) for t in tests), sum(t.get("failed", 0) for t in tests)
        result = "pass" if row.get("passed") else ("not installed: " + row.get("error", "?")) if not row.get(
            "installed") else "FAIL: " + next(t["first_failure"] for t in tests if t["exit"] != 0)[:80]
        lines.append(f"| {torch_v} | {accelerate_v} | {row['at'][:16]} | {passed} / {failed} | {result} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--torch", default="2.9.1,2.10.0,2.11.0,2.12.1,2.13.0,2.14.0", help="comma-separated")
    parser.add_argument("--accelerate", default="1.15.0", help="comma-separated")
    parser.add_argument("--out", help="append one JSON line per pair here")
    parser.add_argument("--table", metavar="JSONL", help="print the newest row per pair of this file as markdown; run nothing")
    args = parser.parse_args()
    if args.table:
        print(table(args.table))
        return 0
    for torch_v in args.torch.split(","):
        for accelerate_v in args.accelerate.split(","):
            work = Path(tempfile.mkdtemp(prefix="ckptdoctor-compat-"))
            try:
                row = one_pair(torch_v, accelerate_v, work)
            finally:
                shutil.rmtree(work, ignore_errors=True)
            line = json.dumps(row)
            print(line, flush=True)
            if args.out:
                with open(args.out, "a") as out:
                    out.write(line + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

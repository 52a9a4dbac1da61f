"""Which torch, Accelerate and torch_npu releases on the package registry lie beyond the gate.

    python benchmarks/release_watch.py            # a table; exit 0 whatever it finds
    python benchmarks/release_watch.py --json     # the same, as JSON

The gate (`ckptdoctor.fix.compat.CHECKED`) refuses any release above its checked range, so a
user who installs a release out the day before we check it is refused. Run this (weekly, or
before a stop) so we notice first: each release above the range is listed with what to do
(`benchmarks/compat_matrix.py --torch X --accelerate Y`, then widen the gate and the newest
stack). torch_npu is named by the torch it is built for (torch_npu 2.14.0 runs torch 2.14.0):
a torch_npu above the checked torch counts as a new torch. Not a test: an upstream release
must not turn CI red. Reads the registry with `pip index versions` (pip's own configuration,
without its constraint file: a local cap must not hide a release).
"""

import argparse
import json
import os
import re
import subprocess
import sys

from ckptdoctor.fix.compat import CHECKED

FINAL = re.compile(r"^(\d+)\.(\d+)\.(\d+)(\.post\d+)?$")
WATCHED = {"torch": "torch", "accelerate": "accelerate", "torch_npu": "torch"}  # package -> the range it is held to


def release(version: str) -> tuple[int, int, int] | None:
    match = FINAL.match(version)
    return tuple(map(int, match.groups()[:3])) if match else None


def registry_versions(package: str) -> list[str]:
    proc = subprocess.run([sys.executable, "-m", "pip", "index", "versions", package], capture_output=True, text=True,
                          env={**os.environ, "PIP_CONSTRAINT": os.devnull})
    line = next((line for line in proc.stdout.splitlines() if line.startswith("Available versions:")), None)
    if line is None:
        raise SystemExit(f"release_watch: the registry did not list {package}: {proc.stderr.strip()[-300:]}")
    return [v.strip() for v in line.split(":", 1)[1].split(",")]


def beyond_the_gate(package: str, versions: list[str]) -> list[str]:
    highest = release(CHECKED[WATCHED[package]][1])
    return [v for v in versions if (r := release(v)) is not None and r > highest]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args(argv)
    found = {}
    for package, held_to in WATCHED.items():
        print(f"reading the registry's {package} releases ...", file=sys.stderr)
        found[package] = {"checked_up_to": CHECKED[held_to][1], "beyond": beyond_the_gate(package, registry_versions(package))}
    if args.json:
        print(json.dumps(found, indent=1))
        return 0
    for package, row in found.items():
        beyond = ", ".join(row["beyond"]) or "none"
        print(f"{package:<11} checked up to {row['checked_up_to']:<7} beyond the gate on the registry: {beyond}")
    if any(row["beyond"] for row in found.values()):
        print("next: python benchmarks/compat_matrix.py --torch <release> --accelerate <release>, then widen "
              "fix/compat.py's CHECKED and the newest stack (requirements/newest-stack.lock)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

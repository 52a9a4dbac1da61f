"""Throughput and memory of `ckptdoctor diagnose` on 200 MB logs: many lines, and one single line.

    .venv/user/bin/python benchmarks/diagnose_throughput.py [--mb 200] [--out docs/evidence/diagnose_throughput.txt]

Each log is torchrun-style training output of 1,144 ranks with `[rankN]:` prefixes, and a
reporter-style gloo timeout traceback every 200,000 lines and at the end; the single-line log is
the same text joined with spaces, as the reporter's own log is. Each diagnosis runs in a fresh
process; wall time gives MB/s, the child's peak resident memory what the diagnosis held, and a
bare interpreter importing ckptdoctor.diagnose is measured alongside as the baseline. The verdict
must name the timeout and rank 7 each time.
"""

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SP = "/usr/local/lib/python3.11/site-packages/torch/distributed"
TRACEBACK = ["[rank7]: Traceback (most recent call last):"] + [
    f'[rank7]:   File "{SP}/{f}", line {n}, in {fn}' for f, n, fn in
    (("checkpoint/state_dict_saver.py", 362, "_save_state_dict"), ("checkpoint/utils.py", 217, "reduce_scatter"),
     ("checkpoint/utils.py", 162, "scatter_object"), ("distributed_c10d.py", 3762, "scatter_object_list"),
     ("distributed_c10d.py", 2830, "broadcast"))] + [
    "[rank7]: RuntimeError: [/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting "
    "1800000ms for recv operation to complete"]
CHILD = """
import json, resource, sys, time
from ckptdoctor.diagnose import diagnose
start = time.perf_counter()
verdict = diagnose(sys.argv[1:]) if sys.argv[1:] else None
print(json.dumps({"s": time.perf_counter() - start, "peak_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
                  "error": verdict and verdict["error"], "ranks": verdict and verdict["ranks"]}))
"""


def write_log(path: Path, megabytes: int, single_line: bool) -> int:
    rng, separator, size, i = random.Random(1), " " if single_line else "\n", 0, 0
    with open(path, "w") as f:
        while size < megabytes * 1_000_000:
            line = (f"[rank{i % 1144}]: step {i} loss {rng.random():.4f} lr 1e-4 tokens/s {rng.randint(1, 99999)} "
                    f"grad_norm {rng.random():.3f} mem 61.2GiB" + separator)
            f.write(line)
            size, i = size + len(line), i + 1
            if i % 200_000 == 0:
                f.write(separator.join(TRACEBACK) + separator)
        f.write(separator.join(TRACEBACK) + "\n")
    return path.stat().st_size


def run_child(*paths) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, *map(str, paths)], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=200)
    parser.add_argument("--out", help="append the results here")
    args = parser.parse_args()
    baseline = run_child()
    lines = [f"baseline (interpreter + import): peak {baseline['peak_kb'] / 1024:.0f} MB"]
    with tempfile.TemporaryDirectory() as scratch:
        for single in (False, True):
            path = Path(scratch) / ("single.log" if single else "multi.log")
            size = write_log(path, args.mb, single)
            result = run_child(path)
            assert result["error"] == "gloo-timeout" and result["ranks"] == [7], result
            held = (result["peak_kb"] - baseline["peak_kb"]) / 1024
            lines.append(f"{'one line ' if single else 'many lines'}: {size / 1e6:.0f} MB in {result['s']:.1f} s = "
                         f"{size / 1e6 / result['s']:.0f} MB/s; peak {result['peak_kb'] / 1024:.0f} MB "
                         f"({held:.0f} MB above the baseline); verdict {result['error']}, ranks {result['ranks']}")
            path.unlink()
    stamp = time.strftime("%Y-%m-%d %H:%M")
    text = "\n".join([f"# benchmarks/diagnose_throughput.py --mb {args.mb}  ({stamp}, this machine)"] + lines)
    print(text)
    if args.out:
        with open(args.out, "a") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

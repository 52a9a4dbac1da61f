"""`ckptdoctor selftest`: on the cluster, under its launcher, save and load through the fix and
check the file system."""

from __future__ import annotations

from ..selftest.run import Options
from .arguments import default


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "selftest", help="on the cluster, under its launcher: save and load through the fix, and check the file system",
        description="Run under the job's launcher (torchrun --nproc-per-node 8 -m ckptdoctor selftest --dir DIR, or "
                    "accelerate launch -m ckptdoctor selftest --dir DIR) at any world size. Builds a MOVA-shaped FSDP2 "
                    "model through Accelerate on the job's device (NPU with torch_npu: cpu:gloo,npu:hccl; CUDA: "
                    "cpu:gloo,cuda:nccl; else gloo), trains it a few steps, saves with ScalableCheckpointing, loads "
                    "back with the fix and with stock Accelerate, and compares each rank's checksums. Also checks the "
                    "directory on every rank, directory fsync, mtime resolution, free space, ulimit -n, the store's "
                    "capacity against the heartbeats, the checkpoint group's creation and the step's visibility on "
                    "every rank. Rank 0 prints one screen of verdicts.",
        epilog="exit status (every rank): 0 every check passed; 1 a check failed or was skipped; 2 bad input")
    parser.add_argument("--dir", required=True, help="a directory on the job's checkpoint storage (a fresh "
                                                     "subdirectory is made in it and removed after)")
    parser.add_argument("--width", type=int, default=default(Options, "width"),
                        help="model width (default %(default)s)")
    parser.add_argument("--layers", type=int, default=default(Options, "layers"),
                        help="blocks in the video tower (default %(default)s)")
    parser.add_argument("--steps", type=int, default=default(Options, "steps"),
                        help="optimizer steps before the save (default %(default)s)")
    parser.add_argument("--no-offload", action="store_true", help="keep parameters on the device (MOVA offloads)")
    parser.add_argument("--stock", action="store_true",
                        help="also time stock DCP's plan exchange on the same state (a group with --stock-deadline)")
    parser.add_argument("--stock-deadline", type=float, default=default(Options, "stock_deadline_s"),
                        help="seconds (default %(default).0f)")
    parser.add_argument("--job-ranks", type=int, default=None,
                        help="the real job's world size, for ulimit -n and the store's load (default: this run's)")
    parser.add_argument("--expect-gb", type=float, default=None,
                        help="the real job's checkpoint size in GB, for the free-space check (default: this run's)")
    parser.add_argument("--visibility", type=float, default=default(Options, "visibility_s"),
                        help="seconds a rank may take to see the published step (default %(default).0f)")
    parser.add_argument("--backend", default=None, help="override the detected backend (e.g. gloo)")
    parser.add_argument("--timeout", type=float, default=default(Options, "timeout_s"),
                        help="the process group's timeout in s (default %(default).0f)")
    parser.add_argument("--keep", action="store_true", help="keep the test's checkpoint directory")
    parser.add_argument("--async", dest="async_save", action="store_true",
                        help="save in the background (as async_save=True / CKPTDOCTOR_ASYNC=1): the check reports how "
                             "long training waited for the host copy, and zeroes the shards while the write runs")
    parser.add_argument("--json", metavar="PATH", help="rank 0 writes the report here")
    parser.set_defaults(func=run)


def run(args) -> int:
    from ..selftest.run import format_report, run as run_selftest, write_json

    opts = Options(dir=args.dir, width=args.width, layers=args.layers, steps=args.steps,
                   offload=not args.no_offload, stock=args.stock, stock_deadline_s=args.stock_deadline,
                   job_ranks=args.job_ranks, expect_gb=args.expect_gb, visibility_s=args.visibility,
                   backend=args.backend, timeout_s=args.timeout, keep=args.keep, async_save=args.async_save)
    status, report = run_selftest(opts, progress=lambda line: print(line, flush=True))
    if report is not None:
        print(format_report(report), flush=True)
        if args.json:
            write_json(report, args.json)
            print(f"  report: {args.json}")
    return status

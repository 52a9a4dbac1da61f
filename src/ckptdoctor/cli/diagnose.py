"""`ckptdoctor diagnose`: explain a failed save or load from torchrun or Accelerate logs."""

from __future__ import annotations

import argparse

from .arguments import write_json


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "diagnose", help="explain a failed save/load from torchrun or Accelerate logs",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Streams the logs (plain or gzip, any size, a directory of them; [rankN]: prefixes interleaved, "
                    "multi-line or collapsed onto one line) and reports the error, the failing operation, phase and "
                    "wait, who reported it, whom they waited for, the timeout, each rank's collective, the nodes and "
                    "versions the log shows, and the likely causes. Every finding says how sure it is (certain: "
                    "read from the log; likely: inferred by a stated rule) and the lines it rests on; what the log "
                    "does not show is reported as unknown.",
        epilog="exit status: 0 a failure was recognised and diagnosed; 1 no known failure pattern in the logs "
               "(the frames found are shown); 2 bad input (a missing or unreadable file). A truncated gzip is read "
               "up to where it breaks, and the report says so.")
    parser.add_argument("logs", nargs="+", metavar="LOG", help="log files or directories of log files")
    parser.add_argument("--ranks-per-node", type=int, default=None,
                        help="name nodes as rank // N when the log has no host lines (off by default: a guess)")
    parser.add_argument("--json", metavar="PATH", help="write the machine-readable diagnosis here")
    parser.set_defaults(func=run)


def run(args) -> int:
    from ..diagnose import diagnose, format_report

    verdict = diagnose(args.logs, ranks_per_node=args.ranks_per_node)
    print(format_report(verdict))
    write_json(args.json, verdict.to_dict())
    return 0 if verdict.known else 1

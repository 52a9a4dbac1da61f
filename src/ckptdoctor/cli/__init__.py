"""`ckptdoctor` command line: a thin layer over the library, one module per subcommand.

Each module here holds one subcommand whole: `register(subparsers)` adds its parser (flags,
help, exit statuses) and `run(args)` turns the parsed flags into the options object its
library entry point takes and calls it. Defaults and checks of values live on those options
objects (`ReproOptions`, `CheckOptions`, selftest's `Options`, ...), so each exists once; the
parser reads its defaults from them. Building the parser imports no torch: a command's
library is imported when the command runs.

Exit status 2 and one line on stderr for any `CkptDoctorError`, whichever command raised it.
"""

from __future__ import annotations

import argparse
import sys

from ..errors import CkptDoctorError
from . import check, diagnose, docs, integrate, repro, selftest, simulate

COMMANDS = (repro, simulate, check, integrate, selftest, diagnose, docs)  # the order --help lists them in


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ckptdoctor",
        description="Reproduce, explain and fix distributed-checkpoint hangs in FSDP2 + Accelerate training.")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except CkptDoctorError as error:
        print(f"ckptdoctor: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("ckptdoctor: interrupted", file=sys.stderr)
        return 130

"""`ckptdoctor` command line: a thin layer over the library modules."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from .errors import CkptDoctorError


def _writable_dir(path: str) -> Path:
    """Create `path` if needed; a clear error when it cannot be written."""
    target = Path(path)
    try:
        target.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise CkptDoctorError(f"cannot create output directory {target}: {error.strerror}") from None
    if not os.access(target, os.W_OK):
        raise CkptDoctorError(f"output directory {target} is not writable")
    return target


def _write_json(path: str | None, data) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(data, indent=1, default=str))


def cmd_repro(args) -> int:
    from .config import TrainingConfig
    from .repro import ReproOptions, format_report, reproduce
    from .stacks import current_stack

    current_stack()  # a clear error on anything but the pinned stacks
    TrainingConfig(world_size=args.ranks, mode=args.mode)  # validates the layout before any process starts
    if args.ranks < 2:
        raise CkptDoctorError(f"a reproduction needs at least 2 ranks (a coordinator and a peer that waits for it), "
                              f"got {args.ranks}")
    if args.layers < 1:
        raise CkptDoctorError(f"--layers must be at least 1, got {args.layers}")
    opts = ReproOptions(world_size=args.ranks, mode=args.mode, video_layers=args.layers,
                        output_dir=_writable_dir(args.out), deadline_s=args.deadline)
    report = reproduce(opts, progress=lambda line: print(line, flush=True))
    print(format_report(report))
    _write_json(args.json, report)
    return 0 if report["reproduced"] else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ckptdoctor",
        description="Reproduce, explain and fix distributed-checkpoint hangs in FSDP2 + Accelerate training.")
    sub = parser.add_subparsers(dest="command", required=True)

    repro = sub.add_parser(
        "repro", help="reproduce the save_state gloo timeout with N real ranks on this machine",
        description="Runs a MOVA-shaped model through Accelerate's FSDP2 save_state with N gloo ranks. "
                    "A calibration run measures rank 0's planning; the reproduction then sets the gloo "
                    "deadline between the model and optimizer plan waits, so the optimizer save times out "
                    "in the plan scatter as in the report. Exit 0 when reproduced as stated.")
    repro.add_argument("--ranks", type=int, default=8, help="number of ranks (default 8)")
    repro.add_argument("--mode", choices=("sft", "lora"), default="sft", help="full fine-tuning or LoRA (default sft)")
    repro.add_argument("--layers", type=int, default=12, help="DiT blocks per video tower (default 12; real: 40)")
    repro.add_argument("--deadline", type=float, default=None,
                       help="gloo deadline in seconds (default: chosen from a calibration run)")
    repro.add_argument("--out", default="runs/repro", help="working directory for logs and checkpoints")
    repro.add_argument("--json", metavar="PATH", help="write the machine-readable report here")
    repro.set_defaults(func=cmd_repro)
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


if __name__ == "__main__":
    sys.exit(main())

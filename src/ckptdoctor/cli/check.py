"""`ckptdoctor check`: before a launch, predict rank 0's planning (and, asked, the resume) at N."""

from __future__ import annotations

from ..check.preflight import CheckOptions
from .arguments import default, write_json


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "check", help="before launching: predict rank 0's planning time for a layout and warn",
        description="Runs the cost model (torch's own planner on meta tensors under its fake process group, measured "
                    "at small N and fitted beyond) with the torch installed here, for MOVA's saves or an existing "
                    "checkpoint's, and warns when a stock save would plan for a given fraction of the deadline. "
                    "Takes a few minutes.",
        epilog="exit status: 0 no warning; 3 a stock save (or, with --load, a stock resume) reaches --warn-fraction of "
               "the deadline, or, with --async, this host has less free memory than a node's host copy; 2 bad input")
    parser.add_argument("--ranks", type=int, required=True, help="world size N")
    parser.add_argument("--layout", default=default(CheckOptions, "layout"),
                        help="fsdp or hsdp:S (default %(default)s)")
    parser.add_argument("--mode", choices=("sft", "lora"), default=default(CheckOptions, "mode"),
                        help="MOVA's training mode (default %(default)s)")
    parser.add_argument("--from-checkpoint", metavar="DIR",
                        help="predict the saves of this DCP checkpoint instead of MOVA's: DIR holds a .metadata, or "
                             "its subdirectories do (an Accelerate save_state directory). A tensor the checkpoint "
                             "holds in several chunks is taken as FSDP-sharded, one in a single chunk as replicated")
    parser.add_argument("--load", action="store_true",
                        help="also predict the resume (load_state) at N: every rank's .metadata read and memory, "
                             "rank 0's load-plan exchange, stock and the fix (measured at N, and at N = 8 and 64 for "
                             "the fit of stock's .metadata past 2 million chunks)")
    parser.add_argument("--async", dest="async_save", action="store_true",
                        help="also predict an async save (async_save=True): rank 0's host copy per save, per rank and "
                             "per node, this host's free memory, the copy's time at this host's copy rate, and what "
                             "moves to the background")
    parser.add_argument("--ranks-per-node", type=int, default=default(CheckOptions, "ranks_per_node"),
                        help="ranks on one node, for --async (default %(default)s)")
    parser.add_argument("--torch", default=None,
                        help="the job's torch version, checked against the one installed here (check measures the "
                             "torch installed with its interpreter: run it in the job's image; in a checkout, "
                             ".venv/<stack>/bin/ckptdoctor)")
    parser.add_argument("--deadline", type=float, default=default(CheckOptions, "deadline_s"),
                        help="the save's gloo deadline in s (default %(default).0f)")
    parser.add_argument("--warn-fraction", type=float, default=default(CheckOptions, "warn_fraction"),
                        help="warn at this fraction (default %(default)s)")
    parser.add_argument("--json", metavar="PATH", help="write the records, notes and warnings here")
    parser.set_defaults(func=run)


def run(args) -> int:
    from ..check.save_model import format_table
    from ..check.preflight import run_check

    opts = CheckOptions(ranks=args.ranks, layout=args.layout, mode=args.mode, checkpoint=args.from_checkpoint,
                        torch_version=args.torch, load=args.load, async_save=args.async_save,
                        ranks_per_node=args.ranks_per_node, deadline_s=args.deadline, warn_fraction=args.warn_fraction)
    result = run_check(opts, progress=lambda line: print(line, flush=True))
    print(format_table(result["records"]))
    if result["load_records"]:
        from ..check.load_model import format_table as format_loads

        print(format_loads(result["load_records"]))
    if result["host_copy"]:
        from ..check.host_copy_model import format_lines

        copy = result["host_copy"]
        print("\n".join(format_lines(copy, copy["background_planning_s"], copy["background_finish_s"],
                                  (copy["free_bytes"], copy["free_source"]))))
    for line in result["notes"]:
        print(f"note: {line}")
    for line in result["warnings"]:
        print(f"WARNING: {line}")
    if not result["warnings"]:
        print(f"OK: every save plans in under {args.warn_fraction:.0%} of the {args.deadline:.0f} s deadline")
    write_json(args.json, result)
    return 3 if result["warnings"] else 0

"""`ckptdoctor simulate`: a save (or, --op load, a resume) at N ranks on torch's own code (the lab)."""

from __future__ import annotations

from ..check.save_model import ScalingOptions
from ..check.layout import Layout
from .arguments import default, int_list, write_json

RANKS = [8, 64, 256, 1144, 2816]  # a reproduction's, the reporter's (1,144) and the next scale's (2,816)
LAYOUTS = "fsdp,hsdp:8"


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "simulate", help="a save (or, --op load, a resume) at N ranks, on torch's own code",
        description="--op save (default): builds every rank's local save plan for MOVA's real shapes with torch's "
                    "DefaultSavePlanner (meta DTensors, fake process group, derived by symmetry from rank 0), then "
                    "times rank 0's work as dcp.save does it. --op load: writes the checkpoint such a save writes "
                    "(stock's .metadata and ckptdoctor's index), then times every rank's metadata read and read plan "
                    "and rank 0's plan exchange, with the memory they hold. Whatever does not fit in memory or time "
                    "is extrapolated from measured points, and labelled so.")
    parser.add_argument("--op", choices=("save", "load"), default="save", help="simulate the save (default) or the load")
    parser.add_argument("--ranks", type=int_list, default=RANKS, help="comma-separated N values")
    parser.add_argument("--layout", default=LAYOUTS, help="fsdp and/or hsdp:S, comma-separated (default both)")
    parser.add_argument("--mode", choices=("sft", "lora"), default=default(ScalingOptions, "mode"))
    parser.add_argument("--planner", choices=("stock", "ours", "both"), default="both",
                        help="stock DefaultSavePlanner, ckptdoctor's ScalableSavePlanner, or both (default)")
    parser.add_argument("--stack", choices=("user", "newest", "both"), default="both")
    parser.add_argument("--max-measured", type=int, default=default(ScalingOptions, "max_measured"),
                        help="materialise every plan up to this N; extrapolate beyond (default %(default)s)")
    parser.add_argument("--json", metavar="PATH", help="write the records here")
    parser.add_argument("--plot", metavar="PNG", help="write a log-log plot of planning time against N")
    parser.set_defaults(func=run)


def run(args) -> int:
    from ..check.save_model import build_records, format_table, measure_all
    from ..simulate.scaling import plot, stack_python

    layouts = [Layout.parse(x) for x in args.layout.split(",")]
    for n in args.ranks:
        for layout in layouts:
            layout.check(n)
    stacks = ["user", "newest"] if args.stack == "both" else [args.stack]
    if args.op == "load":
        return _run_load(args, layouts, stacks)
    planners = ("stock", "ours") if args.planner == "both" else (args.planner,)
    opts = ScalingOptions(ranks=sorted(set(args.ranks)), layouts=layouts, mode=args.mode, stacks=stacks,
                          planners=planners, max_measured=args.max_measured)
    print(f"simulating MOVA ({args.mode}) saves at N={','.join(map(str, opts.ranks))}, layouts "
          f"{','.join(map(str, layouts))}, stacks {','.join(stacks)} (measured up to N={opts.max_measured}, "
          f"validation up to N={opts.max_validated})", flush=True)
    records = build_records(opts, measure_all(opts, progress=lambda line: print(line, flush=True),
                                              python_for=stack_python))
    print(format_table(records))
    write_json(args.json, records)
    if args.plot:
        plot(records, args.plot)
        print(f"plot: {args.plot}")
    return 0


def _run_load(args, layouts, stacks) -> int:
    from ..check.load_model import LoadOptions, build_records, format_table, measure_all
    from ..simulate.scaling import stack_python

    opts = LoadOptions(ranks=sorted(set(args.ranks)), layouts=layouts, mode=args.mode, stacks=stacks)
    print(f"simulating MOVA ({args.mode}) loads at N={','.join(map(str, opts.ranks))}, layouts "
          f"{','.join(map(str, layouts))}, stacks {','.join(stacks)} (stock .metadata materialised up to "
          f"{opts.stock_chunk_budget:,} chunks)", flush=True)
    records = build_records(opts, measure_all(opts, progress=lambda line: print(line, flush=True),
                                              python_for=stack_python))
    print(format_table(records))
    write_json(args.json, records)
    return 0

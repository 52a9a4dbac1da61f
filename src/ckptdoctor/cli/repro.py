"""`ckptdoctor repro`: the 8-rank reproduction of the save_state gloo timeout (the lab)."""

from __future__ import annotations

import argparse

from ..repro.reproduce import DEFAULT_LAYERS, TRAINERS, ReproOptions
from .arguments import default, write_json, writable_dir


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "repro", help="reproduce the save_state gloo timeout with N real ranks on this machine",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Runs a training job through Accelerate's FSDP2 save_state with N gloo ranks: MOVA's own trainer "
                    "(--trainer mova, from the MOVA extract) or ckptdoctor's look-alike. A calibration run (two saves, "
                    "long deadline) measures every wait of the default group; the reproduction then sets the gloo "
                    "deadline between the waits that must pass and the peers' wait for rank 0 in the plan scatter, so "
                    "the save times out there, as in the report. An attempt that fails elsewhere moves the bounds "
                    "and tries again.",
        epilog="exit status: 0 reproduced as stated (or, with --fix, saved and verified); 1 not reproduced after "
               "--attempts; 2 bad input; 4 the job's waits cannot be separated (the message says what to change)")
    parser.add_argument("--trainer", choices=TRAINERS, default=default(ReproOptions, "trainer"),
                        help="MOVA's own trainer code (needs its extract: --extract), ckptdoctor's look-alike, or auto "
                             "(default): MOVA's when its extract is found, else the look-alike")
    parser.add_argument("--ranks", type=int, default=default(ReproOptions, "world_size"),
                        help="number of ranks (default %(default)s)")
    parser.add_argument("--mode", choices=("sft", "lora"), default=default(ReproOptions, "mode"),
                        help="full fine-tuning or LoRA (default %(default)s)")
    parser.add_argument("--layers", type=int, default=None,
                        help=f"DiT blocks per video tower (default {max(DEFAULT_LAYERS.values())}; MOVA's real towers: 40)")
    parser.add_argument("--deadline", type=float, default=None,
                        help="gloo deadline in seconds (default: chosen from a calibration run)")
    parser.add_argument("--attempts", type=int, default=default(ReproOptions, "attempts"),
                        help="reproduction attempts before giving up (default %(default)s)")
    parser.add_argument("--fix", action="store_true",
                        help="save with ScalableCheckpointing at the deadline that makes stock time out (the MOVA "
                             "trainer: with patches/mova-feat-npu.patch applied)")
    parser.add_argument("--async", dest="async_save", action="store_true",
                        help="with --fix: save in the background (CKPTDOCTOR_ASYNC=1); the report gives how long "
                             "training waited per save")
    parser.add_argument("--no-roundtrip", action="store_true",
                        help="with --fix: save only, without loading the checkpoint back and comparing it bit for "
                             "bit (a shorter job; the round trip is the default)")
    parser.add_argument("--integration", choices=("full", "minimal"), default=default(ReproOptions, "integration"),
                        help="with --fix on MOVA's trainer: full = patches/mova-feat-npu.patch (default); minimal = "
                             "`ckptdoctor integrate` (one call after accelerator.prepare)")
    parser.add_argument("--extract", metavar="DIR", help="the MOVA extract (default $CKPTDOCTOR_MOVA_EXTRACT or "
                                                          "../shared/mova-feat-npu)")
    parser.add_argument("--no-offload", action="store_true",
                        help="fsdp_offload_params false (the user runs with true)")
    parser.add_argument("--cp", type=int, default=default(ReproOptions, "cp_size"),
                        help="context-parallel size folded into the FSDP mesh (the user's file: 4); needs --deadline")
    parser.add_argument("--out", default=str(default(ReproOptions, "output_dir")),
                        help="working directory for logs and checkpoints, relative to the current directory "
                             "(default %(default)s); --fix reuses the deadline of a reproduction recorded there")
    parser.add_argument("--json", metavar="PATH",
                        help="write the machine-readable report here (default OUT/report.json; with --fix, "
                             "OUT/fix-report.json)")
    parser.set_defaults(func=run)


def run(args) -> int:
    from ..repro.reproduce import NotSeparable, format_report, reproduce
    from ..repro.stacks import current_stack

    current_stack()  # a clear error on anything but the pinned stacks
    opts = ReproOptions(world_size=args.ranks, mode=args.mode, trainer=args.trainer, video_layers=args.layers,
                        output_dir=args.out, deadline_s=args.deadline, attempts=args.attempts,
                        offload_params=not args.no_offload, cp_size=args.cp, fix=args.fix, extract=args.extract,
                        integration=args.integration, async_save=args.async_save,
                        roundtrip=not args.no_roundtrip)
    writable_dir(args.out)
    json_path = args.json or str(opts.output_dir / ("fix-report.json" if args.fix else "report.json"))
    try:
        report = reproduce(opts, progress=lambda line: print(line, flush=True))
    except NotSeparable as error:
        print(f"NOT SEPARABLE: {error}")
        write_json(json_path, {"reproduced": False, "not_separable": str(error)})
        return 4
    print(format_report(report))
    write_json(json_path, report)
    print(f"  report: {json_path}")
    if args.fix:
        return 0 if report["fixed"] else 1
    if report["reproduced"]:
        return 0
    return 4 if report.get("not_separable") else 1

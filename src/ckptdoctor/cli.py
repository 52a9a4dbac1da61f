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
    return target.absolute()


def _write_json(path: str | None, data) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(data, indent=1, default=str))


def cmd_repro(args) -> int:
    from .repro.config import TrainingConfig
    from .repro.reproduce import NotSeparable, ReproOptions, format_report, reproduce
    from .repro.stacks import current_stack

    current_stack()  # a clear error on anything but the pinned stacks
    TrainingConfig(world_size=args.ranks, mode=args.mode, cp_size=args.cp)  # validates the layout first
    if args.ranks < 2:
        raise CkptDoctorError(f"a reproduction needs at least 2 ranks (a coordinator and a peer that waits for it), "
                              f"got {args.ranks}")
    if args.layers is not None and args.layers < 1:
        raise CkptDoctorError(f"--layers must be at least 1, got {args.layers}")
    if args.attempts < 1:
        raise CkptDoctorError(f"--attempts must be at least 1, got {args.attempts}")
    if args.trainer != "lookalike" and (args.cp > 1 or args.no_offload or args.ranks != 8):
        raise CkptDoctorError("MOVA's trainer runs MOVA's own accelerate config (fsdp_8.yaml: 8 ranks, cp 4, offload): "
                              "--ranks, --cp and --no-offload are the look-alike trainer's (add --trainer lookalike)")
    opts = ReproOptions(world_size=args.ranks, mode=args.mode, trainer=args.trainer, video_layers=args.layers,
                        output_dir=_writable_dir(args.out), deadline_s=args.deadline, attempts=args.attempts,
                        offload_params=not args.no_offload, cp_size=args.cp, fix=args.fix, extract=args.extract,
                        integration=args.integration)
    if args.integration != "full" and not args.fix:
        raise CkptDoctorError("--integration chooses how the fix reaches MOVA's trainer: it needs --fix")
    if args.cp > 1 and args.deadline is None:
        raise CkptDoctorError("--cp > 1 puts training on the default group, so it needs an explicit long --deadline")
    json_path = args.json or str(opts.output_dir / ("fix-report.json" if args.fix else "report.json"))
    try:
        report = reproduce(opts, progress=lambda line: print(line, flush=True))
    except NotSeparable as error:
        print(f"NOT SEPARABLE: {error}")
        _write_json(json_path, {"reproduced": False, "not_separable": str(error)})
        return 4
    print(format_report(report))
    _write_json(json_path, report)
    print(f"  report: {json_path}")
    if args.fix:
        return 0 if report["fixed"] else 1
    if report["reproduced"]:
        return 0
    return 4 if report.get("not_separable") else 1


def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError("expected at least one number")
    return values


def cmd_simulate(args) -> int:
    from .check.cost_model import ScalingOptions, build_records, format_table, measure_all
    from .check.layout import Layout
    from .simulate.scaling import plot, stack_python

    layouts = [Layout.parse(x) for x in args.layout.split(",")]
    for n in args.ranks:
        for layout in layouts:
            layout.check(n)
    stacks = ["user", "newest"] if args.stack == "both" else [args.stack]
    if args.op == "load":
        return _simulate_load(args, layouts, stacks)
    planners = ("stock", "ours") if args.planner == "both" else (args.planner,)
    opts = ScalingOptions(ranks=sorted(set(args.ranks)), layouts=layouts, mode=args.mode, stacks=stacks,
                          planners=planners, max_measured=args.max_measured)
    print(f"simulating MOVA ({args.mode}) saves at N={','.join(map(str, opts.ranks))}, layouts "
          f"{','.join(map(str, layouts))}, stacks {','.join(stacks)} (measured up to N={opts.max_measured}, "
          f"validation up to N={opts.max_validated})", flush=True)
    records = build_records(opts, measure_all(opts, progress=lambda line: print(line, flush=True),
                                              python_for=stack_python))
    print(format_table(records))
    _write_json(args.json, records)
    if args.plot:
        plot(records, args.plot)
        print(f"plot: {args.plot}")
    return 0


def _simulate_load(args, layouts, stacks) -> int:
    from .check.load_cost_model import LoadOptions, build_records, format_table, measure_all
    from .simulate.scaling import stack_python

    opts = LoadOptions(ranks=sorted(set(args.ranks)), layouts=layouts, mode=args.mode, stacks=stacks)
    print(f"simulating MOVA ({args.mode}) loads at N={','.join(map(str, opts.ranks))}, layouts "
          f"{','.join(map(str, layouts))}, stacks {','.join(stacks)} (stock .metadata materialised up to "
          f"{opts.stock_chunk_budget:,} chunks)", flush=True)
    records = build_records(opts, measure_all(opts, progress=lambda line: print(line, flush=True),
                                              python_for=stack_python))
    print(format_table(records))
    _write_json(args.json, records)
    return 0


def cmd_diagnose(args) -> int:
    from .diagnose import diagnose, format_report

    verdict = diagnose(args.logs, ranks_per_node=args.ranks_per_node)
    print(format_report(verdict))
    _write_json(args.json, verdict.to_dict())
    return 0 if verdict.known else 1


def cmd_check(args) -> int:
    from .check.cost_model import format_table
    from .check.layout import Layout
    from .check.preflight import run_check

    if not 0 < args.warn_fraction <= 1:
        raise CkptDoctorError(f"--warn-fraction must be in (0, 1], got {args.warn_fraction}")
    result = run_check(args.ranks, Layout.parse(args.layout), args.deadline, args.warn_fraction, mode=args.mode,
                       checkpoint=args.from_checkpoint, torch_version=args.torch, load=args.load,
                       progress=lambda line: print(line, flush=True))
    print(format_table(result["records"]))
    if result["load_records"]:
        from .check.load_cost_model import format_table as format_loads

        print(format_loads(result["load_records"]))
    for line in result["notes"]:
        print(f"note: {line}")
    for line in result["warnings"]:
        print(f"WARNING: {line}")
    if not result["warnings"]:
        print(f"OK: every save plans in under {args.warn_fraction:.0%} of the {args.deadline:.0f} s deadline")
    _write_json(args.json, result)
    return 3 if result["warnings"] else 0


def cmd_integrate(args) -> int:
    from .integrate import AlreadyIntegrated, integrate

    try:
        placed = integrate(args.trainer, check_only=args.check)
    except AlreadyIntegrated as done:
        print(done)
        return 0
    verb = "would insert" if args.check else "inserted"
    print(f"{verb} `{placed.call()}` at {placed.describe()}")
    for note in placed.notes:
        print(f"note: {note}")
    return 0


def cmd_docs(args) -> int:
    from .documents import DOCUMENTS, locate

    if args.name is None:
        for name in DOCUMENTS:
            print(f"{name:14s} {locate(name)}")
        return 0
    path = locate(args.name)
    print(path if args.path else path.read_text(), end="\n" if args.path else "")
    return 0


def cmd_selftest(args) -> int:
    from .selftest.run import Options, format_report, run, write_json

    for name in ("width", "layers", "steps", "timeout", "visibility"):
        if getattr(args, name) is not None and getattr(args, name) <= 0:
            raise CkptDoctorError(f"--{name} must be positive, got {getattr(args, name)}")
    if args.width % 2:
        raise CkptDoctorError(f"--width must be even (the audio tower is half as wide), got {args.width}")
    opts = Options(dir=Path(args.dir), width=args.width, layers=args.layers, steps=args.steps,
                   offload=not args.no_offload, stock=args.stock, stock_deadline_s=args.stock_deadline,
                   job_ranks=args.job_ranks, expect_gb=args.expect_gb, visibility_s=args.visibility,
                   backend=args.backend, timeout_s=args.timeout, keep=args.keep)
    status, report = run(opts, progress=lambda line: print(line, flush=True))
    if report is not None:
        print(format_report(report), flush=True)
        if args.json:
            write_json(report, args.json)
            print(f"  report: {args.json}")
    return status


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ckptdoctor",
        description="Reproduce, explain and fix distributed-checkpoint hangs in FSDP2 + Accelerate training.")
    sub = parser.add_subparsers(dest="command", required=True)

    repro = sub.add_parser(
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
    repro.add_argument("--trainer", choices=("auto", "mova", "lookalike"), default="auto",
                       help="MOVA's own trainer code (needs its extract: --extract), ckptdoctor's look-alike, or auto "
                            "(default): MOVA's when its extract is found, else the look-alike")
    repro.add_argument("--ranks", type=int, default=8, help="number of ranks (default 8)")
    repro.add_argument("--mode", choices=("sft", "lora"), default="sft", help="full fine-tuning or LoRA (default sft)")
    repro.add_argument("--layers", type=int, default=None,
                       help="DiT blocks per video tower (default 24; MOVA's real towers: 40)")
    repro.add_argument("--deadline", type=float, default=None,
                       help="gloo deadline in seconds (default: chosen from a calibration run)")
    repro.add_argument("--attempts", type=int, default=3, help="reproduction attempts before giving up (default 3)")
    repro.add_argument("--fix", action="store_true",
                       help="save with ScalableCheckpointing at the deadline that makes stock time out (the MOVA "
                            "trainer: with patches/mova-feat-npu.patch applied)")
    repro.add_argument("--integration", choices=("full", "minimal"), default="full",
                       help="with --fix on MOVA's trainer: full = patches/mova-feat-npu.patch (default); minimal = "
                            "`ckptdoctor integrate` (one call after accelerator.prepare)")
    repro.add_argument("--extract", metavar="DIR", help="the MOVA extract (default $CKPTDOCTOR_MOVA_EXTRACT or "
                                                         "../shared/mova-feat-npu)")
    repro.add_argument("--no-offload", action="store_true", help="fsdp_offload_params false (the user runs with true)")
    repro.add_argument("--cp", type=int, default=1,
                       help="context-parallel size folded into the FSDP mesh (the user's file: 4); needs --deadline")
    repro.add_argument("--out", default="runs/repro",
                       help="working directory for logs and checkpoints, relative to the current directory "
                            "(default runs/repro); --fix reuses the deadline of a reproduction recorded there")
    repro.add_argument("--json", metavar="PATH", help="write the machine-readable report here (default OUT/report.json; with --fix, "
                            "OUT/fix-report.json)")
    repro.set_defaults(func=cmd_repro)

    sim = sub.add_parser(
        "simulate", help="a save (or, --op load, a resume) at N ranks, on torch's own code",
        description="--op save (default): builds every rank's local save plan for MOVA's real shapes with torch's "
                    "DefaultSavePlanner (meta DTensors, fake process group, derived by symmetry from rank 0), then "
                    "times rank 0's work as dcp.save does it. --op load: writes the checkpoint such a save writes "
                    "(stock's .metadata and ckptdoctor's index), then times every rank's metadata read and read plan "
                    "and rank 0's plan exchange, with the memory they hold. Whatever does not fit in memory or time "
                    "is extrapolated from measured points, and labelled so.")
    sim.add_argument("--op", choices=("save", "load"), default="save", help="simulate the save (default) or the load")
    sim.add_argument("--ranks", type=_int_list, default=[8, 64, 256, 1144, 2816], help="comma-separated N values")
    sim.add_argument("--layout", default="fsdp,hsdp:8", help="fsdp and/or hsdp:S, comma-separated (default both)")
    sim.add_argument("--mode", choices=("sft", "lora"), default="sft")
    sim.add_argument("--planner", choices=("stock", "ours", "both"), default="both",
                     help="stock DefaultSavePlanner, ckptdoctor's ScalableSavePlanner, or both (default)")
    sim.add_argument("--stack", choices=("user", "newest", "both"), default="both")
    sim.add_argument("--max-measured", type=int, default=16,
                     help="materialise every plan up to this N; extrapolate beyond (default 16)")
    sim.add_argument("--json", metavar="PATH", help="write the records here")
    sim.add_argument("--plot", metavar="PNG", help="write a log-log plot of planning time against N")
    sim.set_defaults(func=cmd_simulate)

    check = sub.add_parser(
        "check", help="before launching: predict rank 0's planning time for a layout and warn",
        description="Runs the cost model (torch's own planner on meta tensors under its fake process group, measured "
                    "at small N and fitted beyond) with the torch installed here, for MOVA's saves or an existing "
                    "checkpoint's, and warns when a stock save would plan for a given fraction of the deadline. "
                    "Takes a few minutes.",
        epilog="exit status: 0 no warning; 3 a stock save (or, with --load, a stock resume) reaches --warn-fraction of "
               "the deadline; 2 bad input")
    check.add_argument("--ranks", type=int, required=True, help="world size N")
    check.add_argument("--layout", default="fsdp", help="fsdp or hsdp:S (default fsdp)")
    check.add_argument("--mode", choices=("sft", "lora"), default="sft", help="MOVA's training mode (default sft)")
    check.add_argument("--from-checkpoint", metavar="DIR",
                       help="predict the saves of this DCP checkpoint instead of MOVA's: DIR holds a .metadata, or "
                            "its subdirectories do (an Accelerate save_state directory). A tensor the checkpoint "
                            "holds in several chunks is taken as FSDP-sharded, one in a single chunk as replicated")
    check.add_argument("--load", action="store_true",
                       help="also predict the resume (load_state) at N: every rank's .metadata read and memory, "
                            "rank 0's load-plan exchange, stock and the fix (measured at N, and at N = 8 and 64 for "
                            "the fit of stock's .metadata past 2 million chunks)")
    check.add_argument("--torch", default=None,
                       help="the job's torch version, checked against the one installed here (check measures the "
                            "torch installed with its interpreter: run it in the job's image; in a checkout, "
                            ".venv/<stack>/bin/ckptdoctor)")
    check.add_argument("--deadline", type=float, default=1800.0, help="the save's gloo deadline in s (default 1800)")
    check.add_argument("--warn-fraction", type=float, default=0.5, help="warn at this fraction (default 0.5)")
    check.add_argument("--json", metavar="PATH", help="write the records, notes and warnings here")
    check.set_defaults(func=cmd_check)

    integ = sub.add_parser(
        "integrate", help="the minimal integration: one call after accelerator.prepare in a trainer file",
        description="Inserts `import ckptdoctor` and `ckptdoctor.install(<accelerator>, save_root=<root>)` right "
                    "after the one statement that assigns a model from <accelerator>.prepare(...), found by the file's "
                    "syntax tree (local lines elsewhere do not matter); the save root is read from the trainer's "
                    "save_state calls when it can be, else a note says to add it. Stops with one line, changing "
                    "nothing, when there is no such statement or more than one, the file already makes a "
                    "ScalableCheckpointing (the full patch), or the file does not parse. Notes a subclass in the same "
                    "package that overrides the edited method.",
        epilog="exit status: 0 inserted (or already there; with --check: it would be); 2 it cannot be placed with "
               "certainty (add the two lines by hand, as the one line printed says)")
    integ.add_argument("trainer", metavar="TRAINER.py", help="the file that calls accelerator.prepare (MOVA: "
                                                             "mova/engine/trainer/accelerate/accelerate_trainer.py)")
    integ.add_argument("--check", action="store_true", help="say where the lines would go; change nothing")
    integ.set_defaults(func=cmd_integrate)

    selftest = sub.add_parser(
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
    selftest.add_argument("--dir", required=True, help="a directory on the job's checkpoint storage (a fresh "
                                                       "subdirectory is made in it and removed after)")
    selftest.add_argument("--width", type=int, default=256, help="model width (default 256)")
    selftest.add_argument("--layers", type=int, default=4, help="blocks in the video tower (default 4)")
    selftest.add_argument("--steps", type=int, default=2, help="optimizer steps before the save (default 2)")
    selftest.add_argument("--no-offload", action="store_true", help="keep parameters on the device (MOVA offloads)")
    selftest.add_argument("--stock", action="store_true",
                          help="also time stock DCP's plan exchange on the same state (a group with --stock-deadline)")
    selftest.add_argument("--stock-deadline", type=float, default=3 * 3600.0, help="seconds (default 10800)")
    selftest.add_argument("--job-ranks", type=int, default=None,
                          help="the real job's world size, for ulimit -n and the store's load (default: this run's)")
    selftest.add_argument("--expect-gb", type=float, default=None,
                          help="the real job's checkpoint size in GB, for the free-space check (default: this run's)")
    selftest.add_argument("--visibility", type=float, default=60.0,
                          help="seconds a rank may take to see the published step (default 60)")
    selftest.add_argument("--backend", default=None, help="override the detected backend (e.g. gloo)")
    selftest.add_argument("--timeout", type=float, default=1800.0, help="the process group's timeout in s (default 1800)")
    selftest.add_argument("--keep", action="store_true", help="keep the test's checkpoint directory")
    selftest.add_argument("--json", metavar="PATH", help="rank 0 writes the report here")
    selftest.set_defaults(func=cmd_selftest)

    diag = sub.add_parser(
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
    diag.add_argument("logs", nargs="+", metavar="LOG", help="log files or directories of log files")
    diag.add_argument("--ranks-per-node", type=int, default=None,
                      help="name nodes as rank // N when the log has no host lines (off by default: a guess)")
    diag.add_argument("--json", metavar="PATH", help="write the machine-readable diagnosis here")
    diag.set_defaults(func=cmd_diagnose)

    docs = sub.add_parser(
        "docs", help="show a document (the guide, the root cause, the reproduction), from a checkout or the wheel",
        description="Prints a document installed with ckptdoctor (the wheel carries them) or, in a checkout, the "
                    "checkout's copy. Without NAME: every document's name and file.",
        epilog="exit status: 0 shown; 2 no such document")
    docs.add_argument("name", nargs="?", metavar="NAME", help="readme, fix-for-mova, root-cause or reproduction")
    docs.add_argument("--path", action="store_true", help="print the file's path instead of its text")
    docs.set_defaults(func=cmd_docs)
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

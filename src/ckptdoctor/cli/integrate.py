"""`ckptdoctor integrate`: the minimal integration, one call after accelerator.prepare in a trainer file."""

from __future__ import annotations


def register(subparsers) -> None:
    parser = subparsers.add_parser(
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
    parser.add_argument("trainer", metavar="TRAINER.py", help="the file that calls accelerator.prepare (MOVA: "
                                                              "mova/engine/trainer/accelerate/accelerate_trainer.py)")
    parser.add_argument("--check", action="store_true", help="say where the lines would go; change nothing")
    parser.set_defaults(func=run)


def run(args) -> int:
    from ..integrate import AlreadyIntegrated, integrate

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

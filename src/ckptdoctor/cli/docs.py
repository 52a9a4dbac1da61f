"""`ckptdoctor docs`: show a document installed with ckptdoctor (or a checkout's copy)."""

from __future__ import annotations


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "docs", help="show a document (the guide, the root cause, the reproduction), from a checkout or the wheel",
        description="Prints a document installed with ckptdoctor (the wheel carries them) or, in a checkout, the "
                    "checkout's copy. Without NAME: every document's name and file.",
        epilog="exit status: 0 shown; 2 no such document")
    parser.add_argument("name", nargs="?", metavar="NAME", help="readme, fix-for-mova, root-cause or reproduction")
    parser.add_argument("--path", action="store_true", help="print the file's path instead of its text")
    parser.set_defaults(func=run)


def run(args) -> int:
    from ..documents import DOCUMENTS, locate

    if args.name is None:
        for name in DOCUMENTS:
            print(f"{name:14s} {locate(name)}")
        return 0
    path = locate(args.name)
    print(path if args.path else path.read_text(), end="\n" if args.path else "")
    return 0

"""Where the user-facing documents are, wherever ckptdoctor runs: `ckptdoctor docs NAME`.

Messages name a document by a stable name (`ckptdoctor docs fix-for-mova`), not by a path in a
checkout, because the people who read them run the installed wheel in a training image. The wheel
installs the documents as data files (`<prefix>/share/ckptdoctor/`, pyproject.toml); in a
checkout they are read where they are. No torch is imported.
"""

from __future__ import annotations

from pathlib import Path

from .errors import CkptDoctorError

DOCUMENTS = {  # stable name -> path in the checkout (and file name in the wheel's share/ckptdoctor)
    "readme": "README.md",
    "fix-for-mova": "docs/fix-for-mova.md",
    "root-cause": "docs/root-cause.md",
    "reproduction": "docs/reproduction.md",
}
SHARE = "share/ckptdoctor"


def command(name: str) -> str:
    """How a message names a document: the command that shows it."""
    if name not in DOCUMENTS:
        raise KeyError(name)
    return f"`ckptdoctor docs {name}`"


def locate(name: str) -> Path:
    """The document's file: this checkout's, else the installed wheel's; one line when neither is there."""
    if name not in DOCUMENTS:
        raise CkptDoctorError(f"no document named {name!r}; there are: {', '.join(DOCUMENTS)}")
    checkout = Path(__file__).resolve().parents[2] / DOCUMENTS[name]
    if checkout.is_file():
        return checkout
    installed = _installed(Path(DOCUMENTS[name]).name)
    if installed is not None:
        return installed
    raise CkptDoctorError(f"{DOCUMENTS[name]} is neither in a checkout beside this ckptdoctor nor installed with it "
                          f"({SHARE}/); reinstall the wheel")


def _installed(filename: str) -> Path | None:
    from importlib import metadata

    try:
        files = metadata.distribution("ckptdoctor").files or []
    except metadata.PackageNotFoundError:
        return None
    for entry in files:
        if entry.name == filename and f"/{SHARE}/" in f"/{entry.as_posix()}":
            path = Path(entry.locate()).resolve()
            if path.is_file():
                return path
    return None

"""`ckptdoctor integrate TRAINER.py`: the minimal integration, placed by the code's structure.

It finds the one statement that assigns a model from `<...>accelerator.prepare(...)` and
inserts, right after it and at its indentation,

    import ckptdoctor  # ckptdoctor: this Accelerator's save_state/load_state through the fix
    ckptdoctor.install(<the same accelerator expression>)

Placement follows Python's syntax tree, not line numbers or context lines, so lines a user
added anywhere else in the file do not move it. It stops with one line, changing nothing,
when the file does not parse, when there is no such statement or more than one, or when the
result would not parse or would not have the call right after that statement. A file already
integrated is left as it is. No torch is imported: it runs anywhere the wheel is installed.
"""

from __future__ import annotations

import ast
import dataclasses
import os
from pathlib import Path

from .errors import CkptDoctorError

MARK = "# ckptdoctor: this Accelerator's save_state/load_state through the fix"


class CannotIntegrate(CkptDoctorError):
    """The file has no single place the integration can go without a person looking."""


@dataclasses.dataclass(frozen=True)
class Placement:
    path: Path
    prepare_lines: tuple[int, int]   # first and last line of the prepare statement (1-based)
    function: str                    # the function it sits in
    accelerator: str                 # the accelerator expression, as written (e.g. self.accelerator)
    inserted_at: int | None = None   # the line of the install call, once written

    def describe(self) -> str:
        where = f"after the prepare at lines {self.prepare_lines[0]}-{self.prepare_lines[1]}, in {self.function}()"
        return f"{self.path}:{self.inserted_at} {where}" if self.inserted_at else where


def find_prepare(tree: ast.Module) -> list[tuple[ast.Assign, str, str]]:
    """Every `<targets incl. a model> = <x>.prepare(...)` with x an accelerator, with the
    enclosing function's name and the accelerator expression's source."""
    found = []
    for function in ast.walk(tree):
        if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(function):
            if isinstance(node, ast.Assign) and _is_prepare(node.value) and _assigns_a_model(node.targets):
                found.append((node, function.name, ast.unparse(node.value.func.value)))
    unique = {id(node): (node, name, acc) for node, name, acc in found}  # nested functions are walked twice
    return sorted(unique.values(), key=lambda item: item[0].lineno)


def _is_prepare(value) -> bool:
    return (isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute) and value.func.attr == "prepare"
            and "accelerator" in ast.unparse(value.func.value).lower())


def _assigns_a_model(targets) -> bool:
    names = [ast.unparse(t) for target in targets for t in (target.elts if isinstance(target, ast.Tuple) else [target])]
    return any(name.split(".")[-1] == "model" for name in names)


def installed_at(tree: ast.Module) -> int | None:
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and ast.unparse(node.func) == "ckptdoctor.install":
            return node.lineno
    return None


def plan(path: Path, source: str) -> Placement:
    tree = _parse(path, source)
    candidates = find_prepare(tree)
    if not candidates:
        raise CannotIntegrate(f"{path}: no `... model ... = <accelerator>.prepare(...)` statement found; add the two "
                              f"lines by hand after your accelerator.prepare (docs/fix-for-mova.md, 'by hand')")
    if len(candidates) > 1:
        lines = ", ".join(str(node.lineno) for node, _, _ in candidates)
        raise CannotIntegrate(f"{path}: {len(candidates)} statements prepare a model (lines {lines}); ckptdoctor will "
                              f"not guess which: add the two lines by hand after the one your training uses")
    node, function, accelerator = candidates[0]
    return Placement(path, (node.lineno, node.end_lineno), function, accelerator)


def integrate(path: str | os.PathLike, check_only: bool = False) -> Placement:
    """Insert the two lines (or, with `check_only`, say where they would go). Raises
    CannotIntegrate with one line when it cannot place them with certainty."""
    path = Path(path)
    try:
        source = path.read_text()
    except OSError as error:
        raise CannotIntegrate(f"{path}: {error.strerror or error}") from None
    tree = _parse(path, source)
    already = installed_at(tree)
    if already is not None:
        raise AlreadyIntegrated(f"{path}:{already}: ckptdoctor.install is already there; nothing changed")
    where = plan(path, source)
    lines = source.splitlines(keepends=True)
    indent = _indent(lines[where.prepare_lines[0] - 1])
    newline = "\r\n" if lines[0].endswith("\r\n") else "\n"
    insert = [f"{indent}import ckptdoctor  {MARK}{newline}", f"{indent}ckptdoctor.install({where.accelerator}){newline}"]
    end = where.prepare_lines[1]
    if not lines[end - 1].endswith(("\n", "\r\n")):
        lines[end - 1] += newline
    result = "".join(lines[:end] + insert + lines[end:])
    placed = dataclasses.replace(where, inserted_at=end + 2)
    _verify(path, result, placed)
    if not check_only:
        _replace(path, result)
    return placed


class AlreadyIntegrated(CkptDoctorError):
    """The file already calls ckptdoctor.install."""


def _verify(path: Path, result: str, placed: Placement) -> None:
    """The new file parses, and the install call is the statement right after the prepare."""
    tree = _parse(path, result)
    for function in ast.walk(tree):
        for body in _bodies(function):
            for i, stmt in enumerate(body[:-2]):
                if isinstance(stmt, ast.Assign) and stmt.lineno == placed.prepare_lines[0] and _is_prepare(stmt.value):
                    follows = body[i + 2]
                    if isinstance(follows, ast.Expr) and ast.unparse(follows.value) == \
                            f"ckptdoctor.install({placed.accelerator})":
                        return
    raise CannotIntegrate(f"{path}: the inserted call would not directly follow the prepare at line "
                          f"{placed.prepare_lines[0]}; nothing changed, add the two lines by hand")


def _bodies(node):
    for field in ("body", "orelse", "finalbody", "handlers"):
        value = getattr(node, field, None)
        if isinstance(value, list) and value and isinstance(value[0], ast.stmt):
            yield value


def _parse(path: Path, source: str) -> ast.Module:
    try:
        return ast.parse(source, filename=str(path))
    except SyntaxError as error:
        raise CannotIntegrate(f"{path}:{error.lineno}: not valid Python ({error.msg}); nothing changed") from None


def _indent(line: str) -> str:
    return line[:len(line) - len(line.lstrip())]


def _replace(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.ckptdoctor-tmp")
    tmp.write_text(text)
    os.chmod(tmp, path.stat().st_mode & 0o7777)
    os.replace(tmp, path)

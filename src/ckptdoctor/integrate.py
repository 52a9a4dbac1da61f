"""`ckptdoctor integrate TRAINER.py`: the minimal integration, placed by the code's structure.

It finds the one statement that assigns a model from `<...>accelerator.prepare(...)` and
inserts, right after it and at its indentation,

    import ckptdoctor  # ckptdoctor: this Accelerator's save_state/load_state through the fix
    ckptdoctor.install(<the same accelerator expression>, save_root=<the trainer's save root>)

Placement follows Python's syntax tree, not line numbers or context lines, so lines a user
added anywhere else in the file do not move it. It stops with one line, changing nothing,
when the file does not parse, when there is no such statement or more than one, when the file
already makes a `ScalableCheckpointing` (the full patch: two integrations would run the fix
inside the fix), or when the result would not parse or would not have the call right after
that statement. A file already integrated is left as it is. No torch is imported: it runs
anywhere the wheel is installed.

The save root (where the trainer's step directories are, so that `install` can set aside a step
a dead save left: fix/publish.py) is read from the file: the argument of the accelerator's
`save_state(...)` calls, followed through `os.path.join`, `/` and local names to the expression
one or two directories above it (`<root>/step-N` or `<root>/step-N/accelerator`). It is passed
only when every save_state call leads to the same `self.<attribute>`, and that attribute is set
in `__init__` before the method holding the prepare runs; otherwise the call has no save_root
and a note says how to add it.

It warns (and still inserts) when a subclass in the same package overrides the method it edits:
a trainer built from that subclass would never run the call, and nothing at startup would say so
but the absence of ckptdoctor's startup line.
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
    save_root: str | None = None     # the save root expression passed to install (e.g. self.save_path)
    notes: tuple[str, ...] = ()      # what a person should look at (a subclass overriding the method, no save root)

    def call(self) -> str:
        root = f", save_root={self.save_root}" if self.save_root else ""
        return f"ckptdoctor.install({self.accelerator}{root})"

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


def full_patch_at(tree: ast.Module) -> int | None:
    """The line of a `ScalableCheckpointing(...)` call (the full patch's), if any."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and ast.unparse(node.func).split(".")[-1] == "ScalableCheckpointing":
            return node.lineno
    return None


def plan(path: Path, source: str) -> Placement:
    tree = _parse(path, source)
    candidates = find_prepare(tree)
    if not candidates:
        raise CannotIntegrate(f"{path}: no `... model ... = <accelerator>.prepare(...)` statement found; add the two "
                              f"lines by hand after your accelerator.prepare: `import ckptdoctor` and "
                              f"`ckptdoctor.install(<accelerator>, save_root=<dir of your step directories>)`")
    if len(candidates) > 1:
        lines = ", ".join(str(node.lineno) for node, _, _ in candidates)
        raise CannotIntegrate(f"{path}: {len(candidates)} statements prepare a model (lines {lines}); ckptdoctor will "
                              f"not guess which: add the two lines by hand after the one your training uses")
    node, function, accelerator = candidates[0]
    _one_accelerator(path, tree, node, accelerator)
    root = save_root(tree, node, function, accelerator)
    notes = [] if root else [f"no save root could be read from {path.name}: pass save_root=<the directory of your step "
                             f"directories> to ckptdoctor.install, so that a step a dead save left is set aside"]
    notes += overridden_in_subclasses(path, tree, node, function)
    return Placement(path, (node.lineno, node.end_lineno), function, accelerator, save_root=root, notes=tuple(notes))


def _one_accelerator(path: Path, tree: ast.Module, prepare: ast.Assign, accelerator: str) -> None:
    """The accelerator that prepares the model is the one the trainer saves through, and no other
    accelerator prepares anything: a second Accelerator's `.model` is not taken for the main one."""
    preparing, saving = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                "accelerator" in ast.unparse(node.func.value).lower():
            if node.func.attr == "prepare":
                preparing.add(ast.unparse(node.func.value))
            elif node.func.attr in ("save_state", "load_state"):
                saving.add(ast.unparse(node.func.value))
    if len(preparing) > 1:
        raise CannotIntegrate(f"{path}: {len(preparing)} accelerators prepare something ({', '.join(sorted(preparing))}); "
                              f"ckptdoctor will not guess which one saves the training state: add the two lines by "
                              f"hand after that one's prepare")
    if saving and accelerator not in saving:
        raise CannotIntegrate(f"{path}:{prepare.lineno}: the model is prepared by {accelerator}, but the trainer saves "
                              f"through {', '.join(sorted(saving))}; nothing changed, add the two lines by hand")


# -- the save root ---------------------------------------------------------------------------

def save_root(tree: ast.Module, prepare: ast.Assign, function: str, accelerator: str) -> str | None:
    """The `self.<attribute>` two (or one) directories above every `<accelerator>.save_state(dir)`
    of the prepare's class, when they agree and it is set before the prepare runs; else None."""
    cls = _class_of(tree, prepare)
    if cls is None:
        return None
    roots = set()
    for method in (n for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))):
        for call in (n for n in ast.walk(method) if isinstance(n, ast.Call)):
            if isinstance(call.func, ast.Attribute) and call.func.attr == "save_state" and call.args and \
                    ast.unparse(call.func.value) == accelerator:
                roots.add(_root_of(call.args[0], _assignments(method, call.lineno)))
    if len(roots) != 1 or None in roots:
        return None
    root = roots.pop()
    return root if _set_before(cls, root, function) else None


def _root_of(expr, names: dict, depth: int = 0, seen: int = 0):
    """Follow `expr` up the directory tree: os.path.join(a, b) and a / b go to a (one level each),
    str()/Path()/os.fspath() are looked through, a local name to its last assignment. The root is
    the `self.<x>` reached one or two levels up."""
    if seen > 8:
        return None
    if isinstance(expr, ast.Call) and ast.unparse(expr.func) in ("os.path.join", "path.join") and len(expr.args) >= 2:
        return _root_of(expr.args[0], names, depth + len(expr.args) - 1, seen + 1)
    if isinstance(expr, ast.BinOp) and isinstance(expr.op, ast.Div):
        return _root_of(expr.left, names, depth + 1, seen + 1)
    if isinstance(expr, ast.Call) and ast.unparse(expr.func) in ("str", "Path", "pathlib.Path", "os.fspath") and \
            len(expr.args) == 1:
        return _root_of(expr.args[0], names, depth, seen + 1)
    if isinstance(expr, ast.Name) and expr.id in names:
        return _root_of(names[expr.id], names, depth, seen + 1)
    text = ast.unparse(expr)
    return text if depth in (1, 2) and text.startswith("self.") and text.count(".") == 1 else None


def _assignments(method, before_line: int) -> dict:
    """Each local name's last plain assignment before `before_line`."""
    found = {}
    for node in sorted((n for n in ast.walk(method) if isinstance(n, ast.Assign)), key=lambda n: n.lineno):
        if node.lineno < before_line and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            found[node.targets[0].id] = node.value
    return found


def _set_before(cls: ast.ClassDef, attribute: str, function: str) -> bool:
    """`attribute` (self.x) is assigned in __init__ before __init__ calls self.<function>() (or,
    when the prepare is in __init__ itself, before the prepare)."""
    init = next((n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"), None)
    if init is None:
        return False
    assigned = [n.lineno for n in ast.walk(init) if isinstance(n, ast.Assign)
                and any(ast.unparse(t) == attribute for t in n.targets)]
    if function == "__init__":
        runs = [n.lineno for n in ast.walk(init) if isinstance(n, ast.Assign) and _is_prepare(n.value)]
    else:
        runs = [n.lineno for n in ast.walk(init) if isinstance(n, ast.Call) and ast.unparse(n.func) == f"self.{function}"]
    return bool(assigned and runs) and min(assigned) < min(runs)


def _class_of(tree: ast.Module, node) -> ast.ClassDef | None:
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        if any(inner is node for inner in ast.walk(cls)):
            return cls
    return None


# -- subclasses that would skip the call ------------------------------------------------------

def overridden_in_subclasses(path: Path, tree: ast.Module, prepare: ast.Assign, function: str) -> list[str]:
    """A note for each class in the same package (the directories above `path` that hold an
    __init__.py) that subclasses the prepare's class and defines `function` itself."""
    cls = _class_of(tree, prepare)
    if cls is None:
        return []
    package = path.resolve().parent
    while (package.parent / "__init__.py").is_file():
        package = package.parent
    notes = []
    for other in sorted(package.rglob("*.py")):
        try:
            other_tree = ast.parse(other.read_text(errors="replace"))
        except (SyntaxError, ValueError, OSError):
            continue
        for sub in (n for n in ast.walk(other_tree) if isinstance(n, ast.ClassDef)):
            if any(ast.unparse(b).split(".")[-1] == cls.name for b in sub.bases) and \
                    any(isinstance(n, ast.FunctionDef) and n.name == function for n in sub.body):
                notes.append(f"{other}:{sub.lineno}: {sub.name} subclasses {cls.name} and overrides {function}(): a "
                             f"trainer built from it never runs the inserted call; add it after that prepare too")
    return notes


def integrate(path: str | os.PathLike, check_only: bool = False) -> Placement:
    """Insert the two lines (or, with `check_only`, say where they would go). Raises
    CannotIntegrate with one line when it cannot place them with certainty."""
    path = Path(path)
    try:
        with open(path, newline="") as f:  # line ends as they are (CRLF kept)
            source = f.read()
    except OSError as error:
        raise CannotIntegrate(f"{path}: {error.strerror or error}") from None
    tree = _parse(path, source)
    already = installed_at(tree)
    if already is not None:
        raise AlreadyIntegrated(f"{path}:{already}: ckptdoctor.install is already there; nothing changed")
    patched = full_patch_at(tree)
    if patched is not None:
        raise CannotIntegrate(f"{path}:{patched}: this trainer already makes a ScalableCheckpointing (the full patch); "
                              f"ckptdoctor.install on top of it would run the fix inside the fix; nothing changed")
    where = plan(path, source)
    lines = source.splitlines(keepends=True)
    indent = _indent(lines[where.prepare_lines[0] - 1])
    newline = "\r\n" if lines[0].endswith("\r\n") else "\n"
    insert = [f"{indent}import ckptdoctor  {MARK}{newline}", f"{indent}{where.call()}{newline}"]
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
                    if isinstance(follows, ast.Expr) and ast.unparse(follows.value) == placed.call():
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
    with open(tmp, "w", newline="") as f:
        f.write(text)
    os.chmod(tmp, path.stat().st_mode & 0o7777)
    os.replace(tmp, path)

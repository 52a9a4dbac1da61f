"""The package's layout is its architecture: a trainer's `import ckptdoctor` pulls in nothing of the lab."""

import json
import subprocess
import sys

import pytest

LAB = ("ckptdoctor.repro", "ckptdoctor.simulate")  # the README's line: everything else is product
TOOLS = ("matplotlib", "hypothesis", "pytest")

SHOW_MODULES = """
import json, sys
exec(sys.argv[1])
print(json.dumps(sorted(sys.modules)))
"""


def modules_after(statement: str) -> list[str]:
    """The modules a fresh interpreter holds after running `statement`."""
    out = subprocess.run([sys.executable, "-c", SHOW_MODULES, statement], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def test_import_ckptdoctor_loads_no_lab_no_plotting_and_not_even_torch():
    loaded = modules_after("import ckptdoctor")
    assert [m for m in loaded if m.startswith("ckptdoctor")] == ["ckptdoctor"]
    assert not [m for m in loaded if m.split(".")[0] in TOOLS + ("torch", "accelerate")]


def test_the_trainer_facing_names_come_from_the_fix_alone():
    loaded = modules_after("from ckptdoctor import ScalableSavePlanner, ScalableFileSystemWriter, "
                           "ScalableCheckpointing, SaveWatchdog, install")
    ours = {m for m in loaded if m.startswith("ckptdoctor")}
    assert not [m for m in ours if m.startswith(LAB)]
    assert {"ckptdoctor.fix.planner", "ckptdoctor.fix.storage", "ckptdoctor.fix.checkpointing",
            "ckptdoctor.fix.watchdog", "ckptdoctor.fix.install"} <= ours
    assert not [m for m in loaded if m.split(".")[0] in TOOLS]
    assert "torch" in loaded  # the fix is DCP's extension points: it does need torch


def test_the_integration_tool_needs_no_torch():
    loaded = modules_after("from ckptdoctor.integrate import integrate")
    assert "torch" not in loaded and not [m for m in loaded if m.startswith(LAB + ("ckptdoctor.fix",))]


def test_log_diagnosis_needs_no_torch():
    loaded = modules_after("from ckptdoctor.diagnose import diagnose")
    assert "torch" not in loaded and not [m for m in loaded if m.startswith(("ckptdoctor.repro", "ckptdoctor.fix"))]


# What each product package may import of ckptdoctor (itself included), read from the sources:
# relative and absolute imports alike, at any depth, also inside functions.
MAY_IMPORT = {
    "fix": ("ckptdoctor.fix", "ckptdoctor.errors", "ckptdoctor.ranks"),
    "check": ("ckptdoctor.check", "ckptdoctor.fix", "ckptdoctor.errors", "ckptdoctor.ranks"),
    "selftest": ("ckptdoctor.selftest", "ckptdoctor.fix", "ckptdoctor.errors", "ckptdoctor.ranks", "ckptdoctor.ports"),
    "diagnose": ("ckptdoctor.diagnose", "ckptdoctor.errors", "ckptdoctor.ranks"),
}


def ckptdoctor_imports(package: str) -> dict[str, set[str]]:
    """Every ckptdoctor module the package's files import, resolved to its absolute name -> the files."""
    import ast
    import importlib
    from pathlib import Path

    root = Path(importlib.import_module("ckptdoctor").__file__).parent
    found: dict[str, set[str]] = {}
    for path in (root / package).rglob("*.py"):
        parts = ("ckptdoctor",) + path.relative_to(root).with_suffix("").parts
        here = parts[:-1]  # the package a relative import is resolved against
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = here[:len(here) - node.level + 1] if node.level else ()
                names = [".".join(base + ((node.module,) if node.module else ()))]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                continue
            for name in names:
                if name == "ckptdoctor" or name.startswith("ckptdoctor."):
                    found.setdefault(name, set()).add(str(path.relative_to(root)))
    return found


@pytest.mark.parametrize("package", list(MAY_IMPORT))
def test_each_product_package_imports_only_what_its_layer_allows(package):
    """The fix imports only itself, errors and ranks; check and selftest (run on the cluster from
    the wheel) add the fix; the log reader needs neither; none of them the lab or plotting."""
    allowed = MAY_IMPORT[package]
    imported = ckptdoctor_imports(package)
    assert any(m.startswith(f"ckptdoctor.{package}") for m in imported)  # the resolver sees this package's own
    wrong = {m: sorted(files) for m, files in imported.items()
             if m != "ckptdoctor" and not any(m == a or m.startswith(a + ".") for a in allowed)}
    assert wrong == {}

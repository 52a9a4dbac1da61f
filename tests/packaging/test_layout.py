"""The package's layout is its architecture: a trainer's `import ckptdoctor` pulls in nothing of the lab."""

import json
import subprocess
import sys

import pytest

LAB = ("ckptdoctor.repro", "ckptdoctor.simulate", "ckptdoctor.diagnose")
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


def test_the_fix_imports_nothing_above_or_beside_it():
    """Read the sources: modules of ckptdoctor.fix import only the fix, errors and ranks."""
    import ast
    from pathlib import Path

    import ckptdoctor.fix

    for path in Path(ckptdoctor.fix.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                target = "." * node.level + (node.module or "")
                assert target.startswith(".") and not target.startswith(("..repro", "..simulate", "..diagnose")), \
                    f"{path.name} imports {target}"


@pytest.mark.parametrize("tool", ["selftest", "check"])
def test_the_tools_a_user_runs_on_the_cluster_need_no_lab(tool):
    """Read the sources (their imports are inside functions): ckptdoctor.selftest and
    ckptdoctor.check import the fix, errors and themselves, never the lab or plotting."""
    import ast
    import importlib
    from pathlib import Path

    package = importlib.import_module(f"ckptdoctor.{tool}")
    for path in Path(package.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                target = "." * node.level + (node.module or "")
                assert not target.startswith(("..repro", "..simulate", "..diagnose")), f"{path.name} imports {target}"
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                assert not [n for n in names if n.split(".")[0] in TOOLS], f"{path.name} imports {names}"
    loaded = modules_after("import ckptdoctor.selftest.run, ckptdoctor.selftest.roundtrip, ckptdoctor.selftest.checks")
    assert not [m for m in loaded if m.startswith(LAB)]

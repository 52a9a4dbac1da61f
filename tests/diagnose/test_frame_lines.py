"""diagnose's table of call-site lines per version (FRAME_LINES) against the installed sources:
every line it lists for this stack's torch and Accelerate lies in the function it names, in the
file it names, and is the call to the next frame of the report's chain; and a traceback with
those lines names this stack's versions."""

import importlib
import inspect
from pathlib import Path

import pytest

from ckptdoctor.diagnose.logs import FRAME_LINES, implied_versions
from ckptdoctor.diagnose.scan import Frame
from ckptdoctor.fix.compat import installed_versions

HERE = dict(zip(("torch", "accelerate"), installed_versions()))
SOURCES = {("torch", "distributed_c10d.py"): "torch.distributed.distributed_c10d",
           ("torch", "checkpoint/utils.py"): "torch.distributed.checkpoint.utils",
           ("torch", "state_dict_saver.py"): "torch.distributed.checkpoint.state_dict_saver",
           ("torch", "checkpoint/logger.py"): "torch.distributed.checkpoint.logger",
           ("torch", "c10d_logger.py"): "torch.distributed.c10d_logger",
           ("accelerate", "accelerator.py"): "accelerate.accelerator",
           ("accelerate", "fsdp_utils.py"): "accelerate.utils.fsdp_utils"}


# what each listed line calls: the next frame of the reported chain (gloo's wait for broadcast)
CALLS = {("distributed_c10d.py", "broadcast"): "work.wait()",
         ("distributed_c10d.py", "scatter_object_list"): "broadcast(",
         ("checkpoint/utils.py", "reduce_scatter"): "self.scatter_object(",
         ("checkpoint/utils.py", "scatter_object"): "scatter_object_list(",
         ("checkpoint/utils.py", "inner_func"): "func(", ("state_dict_saver.py", "save"): "_save_state_dict(",
         ("state_dict_saver.py", "_save_state_dict"): "reduce_scatter(", ("checkpoint/logger.py", "wrapper"): "func(",
         ("c10d_logger.py", "wrapper"): "func(", ("accelerator.py", "save_state"): "save_fsdp_optimizer(",
         ("fsdp_utils.py", "save_fsdp_optimizer"): "dist_cp.save(", ("fsdp_utils.py", "save_fsdp_model"): "dist_cp.save(",
         ("accelerator.py", "load_state"): "load_fsdp_optimizer("}


def functions_holding(path: Path, line: int) -> set[str]:
    """The names of the functions (at any depth) whose source spans `line` of `path`."""
    import ast

    tree = ast.parse(path.read_text())
    return {node.name for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.lineno <= line <= node.end_lineno}


@pytest.mark.parametrize("package", ["torch", "accelerate"])
def test_the_lines_listed_for_this_stack_are_in_the_functions_named(package):
    table = FRAME_LINES.get((package, HERE[package]))
    if table is None:
        pytest.skip(f"diagnose lists no frame lines for {package} {HERE[package]}")
    for (suffix, function), line in table.items():
        path = Path(inspect.getfile(importlib.import_module(SOURCES[package, suffix])))
        assert function in functions_holding(path, line), f"{path}:{line} is not in {function}"
        text = path.read_text().splitlines()[line - 1]
        assert CALLS[suffix, function] in text, f"{path}:{line} is {text.strip()!r}, not the call to the next frame"


def test_a_traceback_with_this_stacks_lines_names_this_stacks_versions():
    frames = [Frame(f"/site-packages/{package}/x/{suffix}", line, function)
              for package in ("torch", "accelerate")
              for (suffix, function), line in FRAME_LINES.get((package, HERE[package]), {}).items()]
    if not frames:
        pytest.skip("diagnose lists no frame lines for this stack")
    found = implied_versions(frames)
    assert {p: v for p, (v, _) in found.items()} == HERE

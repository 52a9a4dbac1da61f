"""`import ckptdoctor.auto`: every Accelerator routed through the fix after its prepare (fix/auto.py).

In a fresh interpreter: the import changes Accelerate's class for the whole process."""

import json
import subprocess
import sys

import pytest

pytest.importorskip("accelerate")

SCRIPT = r"""
import json, sys
from pathlib import Path
import torch
import ckptdoctor.auto
from accelerate import Accelerator
from accelerate.utils import ProjectConfiguration
from ckptdoctor.fix import auto

root = Path(sys.argv[1])
out = {}
for name in ("first", "second"):
    accelerator = Accelerator(cpu=True, project_config=ProjectConfiguration(
        project_dir=str(root / name), automatic_checkpoint_naming=True, total_limit=1))
    accelerator.prepare(torch.nn.Linear(2, 2))
    accelerator.save_state()
    accelerator.save_state()
    out[name] = {"routed": "save_state" in vars(accelerator),
                 "checkpoints": sorted(p.name for p in (root / name / "checkpoints").iterdir()),
                 "marked": (root / name / "checkpoints" / "checkpoint_1" / "CKPTDOCTOR_COMPLETE").is_file()}
auto.disable()
plain = Accelerator(cpu=True)
plain.prepare(torch.nn.Linear(2, 2))
out["after_disable_routed"] = "save_state" in vars(plain)
print(json.dumps(out))
"""


def test_every_accelerator_saves_through_the_fix_after_its_prepare_until_disabled(tmp_path):
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    for name in ("first", "second"):
        assert out[name] == {"routed": True, "checkpoints": ["checkpoint_1"], "marked": True}
    assert out["after_disable_routed"] is False


def test_import_ckptdoctor_alone_changes_nothing_of_accelerate():
    code = ("import accelerate; prepare = accelerate.Accelerator.prepare; import ckptdoctor, ckptdoctor.fix; "
            "print(accelerate.Accelerator.prepare is prepare)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.stdout.strip() == "True", proc.stderr[-2000:]

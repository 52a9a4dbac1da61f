"""The simulator's plans equal the plans of real N-process saves and loads, item by item.

Real jobs: Accelerate's save_state on FSDP2 over gloo, 4 ranks (full fine-tuning) and
8 ranks (LoRA), with the fix, then load_state of what was saved; every rank records the local
save plan DefaultSavePlanner made (ScalableSavePlanner starts from it) and the read plan it
executed (probes.py). The simulator builds the same saves for the same shape in one process
(fake process group, meta DTensors): save plans derived from rank 0's, read plans as stock's
DefaultLoadPlanner makes them for each rank (ScalableLoadPlanner's are the same, tests/fix).
"""

import json
import subprocess
import sys
import dataclasses

import pytest

from ckptdoctor.repro.reproduce import MODEL_SAVE, OPTIMIZER_SAVE, ReproOptions, run_job

pytestmark = pytest.mark.slow
SAVES = {MODEL_SAVE: "model", OPTIMIZER_SAVE: "optimizer"}
JOB_MODULE = "ckptdoctor.check.jobs"  # one entry point for save and load jobs


def simulated(opts: ReproOptions, save: str, op: str = "save") -> list[list]:
    job = {"kind": "plans" if op == "save" else "load-plans", "shape": dataclasses.asdict(opts.shape()),
           "mode": opts.mode, "layout": "fsdp", "save": save, "ranks": opts.world_size}
    out = subprocess.run([sys.executable, "-m", JOB_MODULE, json.dumps(job)], capture_output=True,
                         text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])["plans"]


def normalised(items) -> list:
    return sorted(json.loads(json.dumps(items)))  # tuples -> lists; the planner's item order is not a cost


@pytest.mark.parametrize("world_size,mode", [(4, "sft"), (8, "lora")])
def test_simulated_plans_equal_the_real_ones(tmp_path, world_size, mode):
    opts = ReproOptions(world_size=world_size, mode=mode, trainer="lookalike", video_layers=2, output_dir=tmp_path)
    outcome = run_job(opts, "plans", 1800.0, progress=lambda _: None, time_collectives=True, fix=True)
    assert all(r.get("status") == "ok" for r in outcome.ranks), [r.get("error") for r in outcome.ranks]
    for op in ("save", "load"):
        for dcp_dir, save in SAVES.items():
            sim = simulated(opts, save, op)
            assert len(sim) == world_size
            for rank in outcome.ranks:
                real = [p["items"] for p in rank["plans"] if p.get(op) == dcp_dir]
                assert len(real) == 1, f"rank {rank['rank']}: expected one {op} plan for {dcp_dir}"
                assert len(real[0]) > 10
                assert normalised(real[0]) == normalised(sim[rank["rank"]]), f"rank {rank['rank']}, {save} {op}"

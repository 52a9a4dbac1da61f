"""The simulator's local plans equal the plans of real N-process saves, item by item.

Real jobs: Accelerate's save_state on FSDP2 over gloo, 4 ranks (full fine-tuning) and
8 ranks (LoRA); every rank records the local plan DefaultSavePlanner made (probes.py).
The simulator builds the same saves for the same shape in one process (fake process
group, meta DTensors) and derives every rank's plan from rank 0's.
"""

import json
import subprocess
import sys
import dataclasses

import pytest

from ckptdoctor.repro.reproduce import MODEL_SAVE, OPTIMIZER_SAVE, ReproOptions, run_job

pytestmark = pytest.mark.slow
SAVES = {MODEL_SAVE: "model", OPTIMIZER_SAVE: "optimizer"}


def simulated(opts: ReproOptions, save: str) -> list[list]:
    job = {"kind": "plans", "shape": dataclasses.asdict(opts.shape()), "mode": opts.mode, "layout": "fsdp",
           "save": save, "ranks": opts.world_size}
    out = subprocess.run([sys.executable, "-m", "ckptdoctor.simulate.save", json.dumps(job)], capture_output=True,
                         text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])["plans"]


def normalised(items) -> list:
    return sorted(json.loads(json.dumps(items)))  # tuples -> lists; the planner's item order is not a cost


@pytest.mark.parametrize("world_size,mode", [(4, "sft"), (8, "lora")])
def test_simulated_plans_equal_the_real_ones(tmp_path, world_size, mode):
    opts = ReproOptions(world_size=world_size, mode=mode, video_layers=2, output_dir=tmp_path)
    outcome = run_job(opts, "plans", 1800.0, progress=lambda _: None, time_collectives=True)
    assert all(r.get("status") == "ok" for r in outcome.ranks), [r.get("error") for r in outcome.ranks]
    for dcp_dir, save in SAVES.items():
        sim = simulated(opts, save)
        assert len(sim) == world_size
        for rank in outcome.ranks:
            real = [p["items"] for p in rank["plans"] if p["save"] == dcp_dir]
            assert len(real) == 1, f"rank {rank['rank']}: expected one local plan for {dcp_dir}"
            assert len(real[0]) > 10
            assert normalised(real[0]) == normalised(sim[rank["rank"]]), f"rank {rank['rank']}, {save} save"

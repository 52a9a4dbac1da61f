"""plan_group reads the group DCP is about to gather the plans on, on this stack's torch: the
save's own group, none for no_dist, none outside dcp.save (the agreement never runs elsewhere)."""

import json
import subprocess
import sys

SCRIPT = """
import json, os, sys, tempfile
import torch, torch.distributed as dist, torch.distributed.checkpoint as dcp
from ckptdoctor.fix.plan_group import plan_group
from ckptdoctor.ports import free_port

seen = []
class Recording(dcp.DefaultSavePlanner):
    def create_local_plan(self):
        found = plan_group()
        seen.append("none" if found is None else "default" if found.group is None else
                    "subgroup" if found.group is sub else "other")
        return super().create_local_plan()

os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1")
dist.init_process_group("gloo")
sub = dist.new_group([0], backend="gloo")
state = {"w": torch.ones(3)}
with tempfile.TemporaryDirectory() as scratch:
    dcp.save(state, checkpoint_id=scratch + "/a", planner=Recording())
    dcp.save(state, checkpoint_id=scratch + "/b", planner=Recording(), process_group=sub)
    dcp.save(state, checkpoint_id=scratch + "/c", planner=Recording(), no_dist=True)
    planner = Recording()
    planner.set_up_planner(state, None, True)
    planner.create_local_plan()  # driven directly, as check's simulations do
dist.destroy_process_group()
print(json.dumps(seen))
"""


def test_the_planner_sees_the_group_dcp_gathers_its_plans_on_and_none_where_there_is_none():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == ["default", "subgroup", "none", "none"]

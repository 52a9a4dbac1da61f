"""ScalableCheckpointing's pieces that need no process group: publication and LoRA weights."""

import pytest
import torch

from ckptdoctor.checkpointing import COMPLETE_MARKER, ScalableCheckpointing, local_adapter_state
from ckptdoctor.errors import CkptDoctorError


def test_latest_skips_incomplete_and_unmarked_saves(tmp_path):
    for step, marked in ((100, True), (200, True), (300, False)):
        d = tmp_path / f"step-{step}" / "accelerator"
        d.mkdir(parents=True)
        if marked:
            (d / COMPLETE_MARKER).write_text("ok\n")
    staging = tmp_path / "step-400" / "accelerator.incomplete"
    staging.mkdir(parents=True)
    (staging / COMPLETE_MARKER).write_text("ok\n")  # even a marker inside a staging dir does not count
    assert ScalableCheckpointing.latest(tmp_path) == tmp_path / "step-200" / "accelerator"
    assert ScalableCheckpointing.latest(tmp_path / "missing") is None


def test_local_adapter_state_takes_plain_lora_tensors_and_refuses_sharded_ones():
    model = torch.nn.Module()
    model.lora_A = torch.nn.Parameter(torch.arange(4.0))
    model.base = torch.nn.Parameter(torch.ones(2))
    state = local_adapter_state(model)
    assert list(state) == ["lora_A"] and torch.equal(state["lora_A"], torch.arange(4.0))
    assert state["lora_A"].data_ptr() != model.lora_A.data_ptr()  # a copy, safe from the next step
    model.lora_A.placements = ("Shard(0)",)  # what a DTensor parameter carries
    with pytest.raises(CkptDoctorError, match="sharded by FSDP"):
        local_adapter_state(model)
    with pytest.raises(CkptDoctorError, match="no parameter name contains"):
        local_adapter_state(torch.nn.Linear(2, 2))

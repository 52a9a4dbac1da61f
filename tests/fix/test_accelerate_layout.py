"""Accelerate's names for what save_state writes, as the fix reads them (fix/accelerate_layout.py),
against the installed Accelerate's own constants: a rename upstream fails here, on each stack."""

from accelerate.utils import constants

from ckptdoctor.fix.accelerate_layout import (MODEL_PREFIX, OPTIMIZER_PREFIX, RANK0_RNG_STATES, dcp_directories,
                                              is_dcp_name, state_directory)


def test_the_prefixes_are_accelerates_own():
    assert MODEL_PREFIX == f"{constants.FSDP_MODEL_NAME}_"
    assert OPTIMIZER_PREFIX == f"{constants.OPTIMIZER_NAME}_"
    assert RANK0_RNG_STATES == f"{constants.RNG_STATE_NAME}_0.pkl"


def test_a_state_directory_is_found_in_itself_or_in_its_step_directory(tmp_path):
    step = tmp_path / "step-4"
    for name in ("optimizer_0", "pytorch_model_fsdp_1", "pytorch_model_fsdp_0", "other"):
        (step / "accelerator" / name).mkdir(parents=True)
    assert state_directory(step) == step / "accelerator"
    assert state_directory(step / "accelerator") == step / "accelerator"
    assert [p.name for p in dcp_directories(step / "accelerator")] == \
        ["pytorch_model_fsdp_0", "pytorch_model_fsdp_1", "optimizer_0"]
    assert [is_dcp_name(n) for n in ("optimizer_0", "pytorch_model_fsdp_0", "model.safetensors")] == [True, True, False]

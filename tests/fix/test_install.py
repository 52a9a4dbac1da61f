"""`install` wherever Accelerate's own save_state works: one process with no process group (in this
process, tests/support/one_process.py), and a real Accelerate job of several processes: MULTI_CPU
(DDP over gloo), FSDP1 and FSDP2 (SHARDED_STATE_DICT, Accelerate's own path, on CPU; FSDP2 also with
CPU offload), two ranks, Accelerate's automatic checkpoint naming with total_limit
(tests/jobs/accelerate_ddp_job.py). FULL_STATE_DICT is not here: on CPU processes (torch 2.8.0) rank
0 segfaults in FSDP1's full optimizer state dict, in stock Accelerate's own save as with the fix."""

import hashlib
import json
import logging
import pickle

import pytest
import torch

from ckptdoctor.fix.agreement import CheckpointAborted
from ckptdoctor.fix.publish import COMPLETE_MARKER, INCOMPLETE

from support.one_process import names, one_process_accelerator, step, weights  # noqa: F401 (the fixture `make`)
from support.paths import JOBS


# -- one process, no process group -------------------------------------------------------------------

def test_one_process_without_a_process_group_saves_publishes_and_loads_bit_for_bit(make, tmp_path):
    accelerator, model, optimizer, extra = make(fix=True)
    step(model, optimizer, 1.0)
    extra.value = 7
    saved = weights(model)
    out = accelerator.save_state(str(tmp_path / "explicit"))
    assert out == str(tmp_path / "explicit")
    marker = json.loads((tmp_path / "explicit" / COMPLETE_MARKER).read_text())
    assert marker["dcp_checkpoints"] == []  # no FSDP here: Accelerate's own files, published whole
    assert {"model.safetensors", "optimizer.bin", "random_states_0.pkl", "custom_checkpoint_0.pkl"} <= \
        set(names(tmp_path / "explicit"))
    step(model, optimizer, 2.0)
    extra.value = 0
    accelerator.load_state(str(tmp_path / "explicit"))
    assert all(torch.equal(a, b) for a, b in zip(weights(model), saved)) and extra.value == 7


def test_a_failed_save_on_one_process_is_one_error_and_publishes_nothing(make, tmp_path):
    accelerator, model, optimizer, extra = make(fix=True)
    extra.broken = True
    with pytest.raises(CheckpointAborted, match=r"rank\(s\) 0: RuntimeError: disk quota exceeded \(injected\)"):
        accelerator.save_state(str(tmp_path / "failed"))
    assert not (tmp_path / "failed").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("failed")] == \
        [p.name for p in tmp_path.iterdir() if p.name.startswith(f"failed{INCOMPLETE}")]


def test_a_pickled_copy_of_an_installed_accelerator_saves_as_stock_the_original_through_the_fix(make, tmp_path):
    accelerator, *_ = make(fix=True)  # (Accelerate's own __deepcopy__ returns the Accelerator itself)
    twin = pickle.loads(pickle.dumps(accelerator))
    twin.save_state(str(tmp_path / "copy"))
    assert not (tmp_path / "copy" / COMPLETE_MARKER).exists() and (tmp_path / "copy" / "model.safetensors").is_file()
    accelerator.save_state(str(tmp_path / "original"))
    assert (tmp_path / "original" / COMPLETE_MARKER).is_file()


def test_a_bad_argument_fails_as_stocks_error_class_and_as_checkpoint_aborted(make, tmp_path):
    """Accelerate's own multi-process scenario expects `pytest.raises(TypeError)` from a bad
    map_location; the fix's one error on every rank must still be one."""
    accelerator, *_ = make(fix=True)
    accelerator.save_state(str(tmp_path / "saved"))
    with pytest.raises(TypeError, match="Unsupported optimizer map location passed") as caught:
        accelerator.load_state(str(tmp_path / "saved"), map_location="invalid")
    assert isinstance(caught.value, CheckpointAborted) and type(caught.value).__name__ == "CheckpointAborted"
    assert str(caught.value).startswith("checkpoint aborted at 'load_state': rank(s) 0: TypeError: Unsupported")
    again = pickle.loads(pickle.dumps(caught.value))
    assert isinstance(again, TypeError) and isinstance(again, CheckpointAborted) and str(again) == str(caught.value)


@pytest.mark.parametrize("engine", ["DEEPSPEED", "MEGATRON_LM", "XLA"])
def test_a_mode_that_saves_through_its_own_engine_stays_stock_with_one_info_line(engine, make, tmp_path, caplog,
                                                                                  monkeypatch):
    from accelerate import Accelerator
    from accelerate.utils import DistributedType

    import ckptdoctor

    accelerator, *_ = make(fix=False)
    monkeypatch.setattr(Accelerator, "distributed_type", property(lambda self: DistributedType[engine]))
    with caplog.at_level(logging.INFO, logger="ckptdoctor"):
        assert ckptdoctor.install(accelerator) is None and ckptdoctor.install(accelerator) is None
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("ckptdoctor")]
    assert len(lines) == 1 and lines[0].startswith("ckptdoctor.install: ") and "stay stock" in lines[0], lines
    assert "save_state" not in vars(accelerator) and "load_state" not in vars(accelerator)  # Accelerate's own


def test_scalable_checkpointing_made_directly_on_such_a_mode_is_refused_in_one_line(make, monkeypatch):
    from accelerate import Accelerator
    from accelerate.utils import DistributedType

    from ckptdoctor import ScalableCheckpointing
    from ckptdoctor.errors import CkptDoctorError
    from ckptdoctor.fix.checkpointing import OWNER

    accelerator, *_ = make(fix=False)
    monkeypatch.setattr(Accelerator, "distributed_type", property(lambda self: DistributedType.DEEPSPEED))
    with pytest.raises(CkptDoctorError, match=r"^ScalableCheckpointing saves through DCP, and DeepSpeed saves through "
                                              r"its own engine \(model.save_checkpoint\): keep this Accelerator's own"):
        ScalableCheckpointing(accelerator)
    assert getattr(accelerator, OWNER, None) is None  # nothing was set up on it


# -- several ranks under accelerate's launcher --------------------------------------------------------

def ddp_job(tmp_path, mode, *extra, world=2):
    from ckptdoctor.repro.launcher import launch

    out = tmp_path / "-".join((mode, *extra))
    out.mkdir()
    result = launch([str(JOBS / "accelerate_ddp_job.py"), str(out), mode, *extra], world, out / "job.log",
                    timeout_s=300, grace_s=10, env={"ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1",
                                                    "CKPTDOCTOR_GROUP_TIMEOUT_S": "120"})
    reports = [out / f"rank{r}.json" for r in range(world)]
    return result, [json.loads(path.read_text()) for path in reports if path.exists()], out


NOTHING = hashlib.sha256(b"").hexdigest()  # the digest of a rank that holds no element (an empty shard)


# two ranks, and FSDP2 on four (its 3-row weight leaves one rank an empty shard)
@pytest.fixture(scope="module", params=["ddp", "fsdp1", "fsdp2", "fsdp2-offload", "fsdp2-4ranks"])
def runs(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(request.param)
    layout = request.param.removesuffix("-4ranks")
    extra = () if layout == "ddp" else tuple(layout.split("-"))
    world = 4 if layout != request.param else 2
    return request.param, {mode: ddp_job(tmp, mode, *extra, world=world) for mode in ("stock", "fix")}


@pytest.mark.slow
def test_several_ranks_save_and_resume_the_newest_as_stock_does(runs):
    layout, runs = runs
    world = 4 if layout.endswith("-4ranks") else 2
    for mode in ("stock", "fix"):
        result, reports, out = runs[mode]
        assert result.returncodes == [0] * world and len(reports) == world, (out / "job.log").read_text()[-3000:]
        for r in reports:
            assert r["distributed_type"] == ("DistributedType.MULTI_CPU" if layout == "ddp" else "DistributedType.FSDP")
            assert r["loaded"] == r["saved"]  # the newest checkpoint, bit for bit
            assert r["saved"] != r["moved"] or r["saved"] == NOTHING  # a step moved what the rank holds
        assert sum(r["saved"] != NOTHING for r in reports) >= 2
    assert [r["iteration"] for r in runs["fix"][1]] == [r["iteration"] for r in runs["stock"][1]] == [3] * world
    assert runs["stock"][1][0]["checkpoints"] == ["checkpoint_1", "checkpoint_2"]
    if layout != "ddp":  # every save went through DCP, with the fix's writer (its index beside .metadata)
        newest = runs["fix"][2] / "project" / "checkpoints" / "checkpoint_2"
        assert sorted(p.parent.name for p in newest.glob("*/.ckptdoctor-index")) == ["optimizer_0",
                                                                                      "pytorch_model_fsdp_0"]


@pytest.mark.slow
def test_a_save_failing_on_one_rank_is_one_error_on_every_rank_and_keeps_k_complete_checkpoints(runs):
    result, reports, out = runs[1]["fix"]
    errors = {r["error"] for r in reports}
    assert len(errors) == 1 and all(r["error_type"] == "CheckpointAborted" and r["is_oserror"] for r in reports)
    assert errors.pop().startswith("checkpoint aborted at 'save_state': rank(s) 1: OSError: [Errno 28] No space left")
    for r in reports:
        assert r["complete"] == ["checkpoint_1", "checkpoint_2"]  # total_limit=2 kept, the failed 3rd unpublished
        assert [name for name in r["checkpoints"] if not name.startswith("checkpoint_3.incomplete-")] == \
            ["checkpoint_1", "checkpoint_2"]


def whole(checkpoint) -> bool:
    """Every file of the two ranks' save is there (what stock's own load needs)."""
    return all((checkpoint / name).is_file() for name in ("model.safetensors", "optimizer.bin", "random_states_0.pkl",
                                                          "random_states_1.pkl", "custom_checkpoint_0.pkl"))


@pytest.mark.slow
def test_a_rank_killed_in_a_save_leaves_k_complete_checkpoints_where_stock_leaves_k_minus_1(tmp_path):
    """SIGKILL (a real one) of rank 1 at the start of the third save, total_limit=2."""
    left = {}
    for mode in ("stock", "fix"):
        result, _, out = ddp_job(tmp_path, mode, "kill")
        assert result.returncodes[1] == -9, (out / "job.log").read_text()[-2000:]
        root = out / "project" / "checkpoints"
        left[mode] = sorted(p.name for p in root.iterdir() if whole(p) and ".incomplete-" not in p.name)
    assert left["stock"] == ["checkpoint_1"]                       # stock deleted checkpoint_0 first
    assert left["fix"] == ["checkpoint_0", "checkpoint_1"]         # ours removes only after a publish

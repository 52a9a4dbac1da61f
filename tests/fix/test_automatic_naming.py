"""`install` where Accelerate's own save_state works: one process without a process group, and
Accelerate's automatic checkpoint naming with `total_limit` (fix/automatic_naming.py).

In-process, as a trainer is debugged and as Accelerate's own tests run: no launcher, no process
group. Each test compares against what stock Accelerate does in the same situation."""

import json

import pytest
import torch

accelerate = pytest.importorskip("accelerate")

from accelerate import Accelerator  # noqa: E402
from accelerate.state import AcceleratorState  # noqa: E402
from accelerate.utils import ProjectConfiguration  # noqa: E402

import ckptdoctor  # noqa: E402
from ckptdoctor.errors import CkptDoctorError  # noqa: E402
from ckptdoctor.fix.agreement import CheckpointAborted  # noqa: E402
from ckptdoctor.fix.publish import COMPLETE_MARKER, INCOMPLETE  # noqa: E402


class Breakable:
    """A registered object whose state_dict fails on demand: Accelerate saves it after the model
    and optimizer files, so a failure there leaves a half-written checkpoint behind stock."""

    def __init__(self):
        self.broken, self.value = False, 0

    def state_dict(self):
        if self.broken:
            raise RuntimeError("disk quota exceeded (injected)")
        return {"value": self.value}

    def load_state_dict(self, state):
        self.value = state["value"]


@pytest.fixture
def make(tmp_path):
    def make(fix: bool, **project):
        AcceleratorState._reset_state(True)
        assert not torch.distributed.is_initialized()  # the point: no process group at all
        config = ProjectConfiguration(project_dir=str(tmp_path / ("ours" if fix else "stock")), **project)
        accelerator = Accelerator(cpu=True, project_config=config)
        torch.manual_seed(0)
        model = accelerator.prepare(torch.nn.Linear(4, 3))
        optimizer = accelerator.prepare(torch.optim.Adam(model.parameters(), lr=0.1))
        extra = Breakable()
        accelerator.register_for_checkpointing(extra)
        if fix:
            ckptdoctor.install(accelerator)
        return accelerator, model, optimizer, extra

    yield make
    AcceleratorState._reset_state(True)


def step(model, optimizer, value: float) -> None:
    model(torch.full((2, 4), value)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()


def weights(model) -> list:
    return [p.detach().clone() for p in model.parameters()]


def names(directory) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


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


def test_automatic_names_and_counter_are_stocks(make, tmp_path):
    dirs = {}
    for fix in (False, True):
        accelerator, model, optimizer, _ = make(fix=fix, automatic_checkpoint_naming=True)
        for _ in range(3):
            accelerator.save_state()
        dirs[fix] = (names(tmp_path / ("ours" if fix else "stock") / "checkpoints"), accelerator.save_iteration)
    assert dirs[True] == dirs[False] == (["checkpoint_0", "checkpoint_1", "checkpoint_2"], 3)


def test_total_limit_keeps_k_complete_checkpoints_where_a_failed_save_leaves_stock_k_minus_1(make, tmp_path):
    complete = {}
    for fix in (False, True):
        accelerator, model, optimizer, extra = make(fix=fix, automatic_checkpoint_naming=True, total_limit=2)
        for value in (1.0, 2.0, 3.0):
            step(model, optimizer, value)
            accelerator.save_state()
        extra.broken = True
        with pytest.raises((RuntimeError, CheckpointAborted), match="disk quota exceeded"):
            accelerator.save_state()
        root = tmp_path / ("ours" if fix else "stock") / "checkpoints"
        complete[fix] = sorted(p.name for p in root.iterdir()
                               if INCOMPLETE not in p.name and (p / "custom_checkpoint_0.pkl").exists())
    assert complete[False] == ["checkpoint_2"]                     # stock deleted checkpoint_1 before failing
    assert complete[True] == ["checkpoint_1", "checkpoint_2"]      # ours removes only after a publish


def test_total_limit_applies_after_each_publish(make, tmp_path):
    accelerator, model, optimizer, _ = make(fix=True, automatic_checkpoint_naming=True, total_limit=2)
    for _ in range(5):
        accelerator.save_state()
    root = tmp_path / "ours" / "checkpoints"
    assert names(root) == ["checkpoint_3", "checkpoint_4"]
    assert all((root / name / COMPLETE_MARKER).is_file() for name in names(root))


def test_load_state_without_a_directory_loads_the_newest_complete_checkpoint(make, tmp_path):
    accelerator, model, optimizer, _ = make(fix=True, automatic_checkpoint_naming=True)
    step(model, optimizer, 1.0)
    accelerator.save_state()
    step(model, optimizer, 2.0)
    accelerator.save_state()
    newest = weights(model)
    root = tmp_path / "ours" / "checkpoints"
    (root / "checkpoint_7").mkdir()  # a newer folder a dead stock save left: stock would load it
    (root / "checkpoint_7" / "model.safetensors").write_bytes(b"truncated")
    step(model, optimizer, 3.0)
    accelerator.load_state()
    assert all(torch.equal(a, b) for a, b in zip(weights(model), newest))


def test_load_state_without_a_directory_and_no_complete_checkpoint_is_one_line(make, tmp_path):
    accelerator, *_ = make(fix=True, automatic_checkpoint_naming=True)
    (tmp_path / "ours" / "checkpoints").mkdir(parents=True)
    with pytest.raises(CkptDoctorError, match=r"^no complete checkpoint under .*checkpoints; nothing was loaded$"):
        accelerator.load_state()


def test_an_existing_automatic_name_is_refused_and_nothing_is_saved(make, tmp_path):
    accelerator, *_ = make(fix=True, automatic_checkpoint_naming=True)
    (tmp_path / "ours" / "checkpoints" / "checkpoint_0").mkdir(parents=True)
    with pytest.raises(CheckpointAborted, match=r"checkpoint_0 \(0\) already exists.*nothing was saved"):
        accelerator.save_state()
    assert names(tmp_path / "ours" / "checkpoints") == ["checkpoint_0"] and accelerator.save_iteration == 0


def test_without_automatic_naming_a_directory_is_needed(make):
    accelerator, *_ = make(fix=True)
    with pytest.raises(CkptDoctorError, match="needs an output_dir"):
        accelerator.save_state()
    with pytest.raises(CkptDoctorError, match="needs an input_dir"):
        accelerator.load_state()


def test_a_pickled_copy_of_an_installed_accelerator_saves_as_stock_the_original_through_the_fix(make, tmp_path):
    import pickle

    accelerator, *_ = make(fix=True)  # (Accelerate's own __deepcopy__ returns the Accelerator itself)
    twin = pickle.loads(pickle.dumps(accelerator))
    twin.save_state(str(tmp_path / "copy"))
    assert not (tmp_path / "copy" / COMPLETE_MARKER).exists() and (tmp_path / "copy" / "model.safetensors").is_file()
    accelerator.save_state(str(tmp_path / "original"))
    assert (tmp_path / "original" / COMPLETE_MARKER).is_file()


def test_a_bad_argument_fails_as_stocks_error_class_and_as_checkpoint_aborted(make, tmp_path):
    """Accelerate's own multi-process scenario expects `pytest.raises(TypeError)` from a bad
    map_location; the fix's one error on every rank must still be one."""
    import pickle

    accelerator, *_ = make(fix=True)
    accelerator.save_state(str(tmp_path / "saved"))
    with pytest.raises(TypeError, match="Unsupported optimizer map location passed") as caught:
        accelerator.load_state(str(tmp_path / "saved"), map_location="invalid")
    assert isinstance(caught.value, CheckpointAborted) and type(caught.value).__name__ == "CheckpointAborted"
    assert str(caught.value).startswith("checkpoint aborted at 'load_state': rank(s) 0: TypeError: Unsupported")
    again = pickle.loads(pickle.dumps(caught.value))
    assert isinstance(again, TypeError) and isinstance(again, CheckpointAborted) and str(again) == str(caught.value)

"""One Accelerator in this process, with no process group at all (as a trainer is debugged and as
Accelerate's own tests run), stock or with `ckptdoctor.install`: the fixture and helpers the
in-process tests of tests/fix/test_install.py and tests/fix/test_automatic_naming.py share."""

import pytest
import torch


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


@pytest.fixture(name="make")
def one_process_accelerator(tmp_path):
    """`make` in a test: make(fix, **project) -> (accelerator, model, optimizer, breakable): a fresh Accelerator each call."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from accelerate.utils import ProjectConfiguration

    import ckptdoctor

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

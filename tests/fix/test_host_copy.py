"""The async save's host copy (fix/host_copy.py): buffers made once and reused, values fresh."""

import torch

from ckptdoctor.fix.host_copy import HostCopies


def state(scale: float, rows: int = 4) -> dict:
    return {"model": {"w": torch.full((rows, 3), scale), "b": torch.arange(3.0) * scale},
            "param_groups": [{"lr": 0.1 * scale, "params": ["w", "b"]}]}


def test_a_second_save_reuses_the_buffers_and_takes_the_new_values():
    copies = HostCopies()
    live = state(1.0)
    first = copies.stage("model", live)
    pointers = [first["model"]["w"].data_ptr(), first["model"]["b"].data_ptr()]
    assert first["model"]["w"].data_ptr() != live["model"]["w"].data_ptr()  # a copy, not the live tensor
    live["model"]["w"].add_(1.0)  # training changes the state after save_state returned
    assert torch.equal(first["model"]["w"], torch.full((4, 3), 1.0))
    second = copies.stage("model", state(2.0))
    assert [second["model"]["w"].data_ptr(), second["model"]["b"].data_ptr()] == pointers
    assert torch.equal(second["model"]["b"], torch.arange(3.0) * 2.0)
    assert second["param_groups"][0]["lr"] == 0.2  # numbers are taken at each save, not cached
    assert copies.bytes == (4 * 3 + 3) * 4 and copies.tensors("model") == 2


def test_a_state_whose_shapes_changed_gets_new_buffers_and_only_those_are_held():
    copies = HostCopies()
    copies.stage("optimizer", state(1.0, rows=4))
    grown = copies.stage("optimizer", state(3.0, rows=6))
    assert torch.equal(grown["model"]["w"], torch.full((6, 3), 3.0))
    assert copies.bytes == (6 * 3 + 3) * 4  # the old buffers were dropped
    copies.stage("model", state(1.0, rows=2))
    assert copies.bytes == (6 * 3 + 3) * 4 + (2 * 3 + 3) * 4  # one copy per checkpoint name

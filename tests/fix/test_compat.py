"""The version gate: one line naming what is installed, and an explicit, logged override."""

import logging

import pytest

from ckptdoctor.errors import UnsupportedVersion
from ckptdoctor.fix import compat


@pytest.fixture
def unchecked_torch(monkeypatch):
    monkeypatch.setattr(compat, "installed_versions", lambda: ("2.16.0", "1.14.0"))
    monkeypatch.setattr(compat, "_warned", set())


def test_an_unchecked_version_is_refused_in_one_line_that_names_the_override(unchecked_torch, monkeypatch):
    monkeypatch.delenv(compat.OVERRIDE, raising=False)
    with pytest.raises(UnsupportedVersion) as refused:
        compat.check_versions()
    line = str(refused.value)
    assert "\n" not in line and "not torch 2.16.0" in line and "accelerate 1.14.0" in line
    assert "checked on torch 2.8.0 to 2.15.0 and accelerate 1.13.0 to 1.16.0" in line
    assert line.endswith(f"set {compat.OVERRIDE}=1")


@pytest.mark.parametrize("torch_v, accelerate_v, accepted", [
    ("2.8.0", "1.13.0", True), ("2.15.0", "1.16.0", True),   # the user's stack; the newest releases
    ("2.9.1", "1.15.0", True), ("2.12.1", "1.14.0", True),   # inside both ranges
    ("2.14.0", "1.16.0", True), ("2.8.0", "1.16.0", True),   # torch_npu 2.14.0's torch; the user's torch
    ("2.7.1", "1.13.0", False), ("2.16.0", "1.16.0", False),  # below, above
    ("2.15.0a0", "1.16.0", False), ("2.8.0", "1.12.0", False), ("2.8.0", "1.17.0", False),
    ("not installed", "1.13.0", False),
])
def test_the_gate_accepts_the_checked_ranges_and_nothing_else(monkeypatch, torch_v, accelerate_v, accepted):
    monkeypatch.delenv(compat.OVERRIDE, raising=False)
    monkeypatch.setattr(compat, "installed_versions", lambda: (torch_v, accelerate_v))
    if accepted:
        compat.check_versions()
    else:
        with pytest.raises(UnsupportedVersion):
            compat.check_versions()


def test_the_override_warns_once_and_lets_it_run(unchecked_torch, monkeypatch, caplog):
    monkeypatch.setenv(compat.OVERRIDE, "1")
    with caplog.at_level(logging.WARNING, logger="ckptdoctor.fix.compat"):
        compat.check_versions()
        compat.check_versions()
        compat.check_torch("ScalableSavePlanner")
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 2 and all("running anyway because" in w and "(unchecked)" in w for w in warnings)


def test_the_checked_stacks_pass_without_the_override(monkeypatch):
    monkeypatch.delenv(compat.OVERRIDE, raising=False)
    for torch_v, accelerate_v in zip(compat.CHECKED["torch"], compat.CHECKED["accelerate"]):
        monkeypatch.setattr(compat, "installed_versions", lambda: (torch_v, accelerate_v))
        compat.check_versions()

"""The version gate: one line naming what is installed, and an explicit, logged override."""

import logging

import pytest

from ckptdoctor.errors import UnsupportedVersion
from ckptdoctor.fix import compat


@pytest.fixture
def unchecked_torch(monkeypatch):
    monkeypatch.setattr(compat, "installed_versions", lambda: ("2.11.0", "1.14.0"))
    monkeypatch.setattr(compat, "_warned", set())


def test_an_unchecked_version_is_refused_in_one_line_that_names_the_override(unchecked_torch, monkeypatch):
    monkeypatch.delenv(compat.OVERRIDE, raising=False)
    with pytest.raises(UnsupportedVersion) as refused:
        compat.check_versions()
    line = str(refused.value)
    assert "\n" not in line and "not torch 2.11.0" in line and "accelerate 1.14.0" in line
    assert line.endswith(f"set {compat.OVERRIDE}=1")


def test_the_override_warns_once_and_lets_it_run(unchecked_torch, monkeypatch, caplog):
    monkeypatch.setenv(compat.OVERRIDE, "1")
    with caplog.at_level(logging.WARNING, logger="ckptdoctor.compat"):
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

import os

import pytest

from ckptdoctor.repro import launcher
from support.paths import EVIDENCE


def pytest_configure(config):
    """The lab's jobs fork their ranks from a zygote that has imported torch once: about 3 s of
    CPU saved per rank (src/ckptdoctor/repro/zygote.py). CKPTDOCTOR_FRESH_RANKS=1 starts each
    rank as a fresh interpreter, as torchrun does."""
    launcher.PRELOADED_BY_DEFAULT = os.environ.get("CKPTDOCTOR_FRESH_RANKS") != "1"


@pytest.fixture
def user_report_text() -> str:
    return EVIDENCE.read_text()

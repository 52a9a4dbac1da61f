from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# The reporter's log, kept in the repo so that CI on a clean clone tests against it.
EVIDENCE = REPO / "tests" / "data" / "user_report_gloo_timeout.txt"


@pytest.fixture
def user_report_text() -> str:
    return EVIDENCE.read_text()

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
EVIDENCE = REPO.parent / "shared" / "evidence" / "user_report_gloo_timeout.txt"


@pytest.fixture
def user_report_text() -> str:
    if not EVIDENCE.exists():
        pytest.skip(f"the user's report is not beside the repo ({EVIDENCE})")
    return EVIDENCE.read_text()

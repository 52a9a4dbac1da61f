import pytest

from support.paths import EVIDENCE


@pytest.fixture
def user_report_text() -> str:
    return EVIDENCE.read_text()

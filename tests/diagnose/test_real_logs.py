"""`ckptdoctor diagnose` on real logs from public issue threads (tests/data/real, README there):
each finding the thread establishes is reported, nothing the thread does not establish is claimed,
and the text and the JSON say the same."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ckptdoctor.diagnose import diagnose, format_report

REAL = Path(__file__).resolve().parents[1] / "data" / "real"
CASES = sorted(p.stem for p in REAL.glob("*.log"))


def sidecar(name: str) -> dict:
    return json.loads((REAL / f"{name}.json").read_text())


def test_at_least_fifteen_sourced_logs():
    assert len(CASES) >= 15
    for name in CASES:
        meta = sidecar(name)
        assert meta["source"].startswith("https://github.com/") and meta["licence"] and meta["established"]


@pytest.mark.parametrize("name", CASES)
def test_what_the_thread_establishes_is_reported(name):
    expect = sidecar(name)["expect"]
    verdict = diagnose([REAL / f"{name}.log"])
    for field in ("error", "operation", "phase", "waiting_call", "ranks", "local_ranks", "timeout_ms", "desync", "nodes"):
        if field in expect:
            assert verdict[field] == expect[field], field
    if "ranks_include" in expect:
        assert set(expect["ranks_include"]) <= set(verdict["ranks"] or [])
    if "collectives" in expect:
        assert {r: list(v) for r, v in verdict["collectives"].items() if r in expect["collectives"]} == expect["collectives"]
    if "exitcode" in expect:
        assert verdict["exitcodes"] == [expect["exitcode"]]
    if "operation_confidence" in expect:
        assert verdict.finding("operation").confidence == expect["operation_confidence"]
    if "first_cause" in expect:
        assert verdict["causes"][0]["id"] == expect["first_cause"]
    if expect.get("frames_from_faulthandler"):
        assert verdict["frames"] and verdict["frames"][-1].endswith(f"in {expect['waiting_call']}")


@pytest.mark.parametrize("name", CASES)
def test_nothing_the_thread_does_not_establish_is_claimed(name):
    verdict = diagnose([REAL / f"{name}.log"])
    ids = [c["id"] for c in verdict["causes"]]
    for claim in sidecar(name)["must_not"]:
        if claim == "dcp-advice":
            assert "dcp-coordinator-slow" not in ids and not any("Planner" in c["action"] for c in verdict["causes"])
        elif claim == "oom-certain":
            assert "out-of-memory" not in ids and all(c["confidence"] != "certain" for c in verdict["causes"])
        else:
            assert verdict[claim] is None, f"{claim} = {verdict[claim]!r} is not in the log"


@pytest.mark.parametrize("name", CASES)
def test_the_text_and_the_json_render_one_verdict(name, tmp_path):
    out = tmp_path / "v.json"
    proc = subprocess.run([sys.executable, "-m", "ckptdoctor.cli", "diagnose", str(REAL / f"{name}.log"), "--json",
                           str(out)], capture_output=True, text=True)
    data = json.loads(out.read_text())
    assert proc.stdout.strip() == format_report(diagnose([REAL / f"{name}.log"])).strip()
    assert proc.returncode == (0 if data["known"] else 1)
    if data["known"]:
        assert proc.stdout.startswith(f"failure: {data['error']['value']} ")
    else:
        assert "unknown failure pattern" in proc.stdout
    for cause in data["causes"]:
        assert cause["cause"] in proc.stdout
    for field in ("ranks", "timeout_ms", "waiting_on"):
        if data[field]["value"] is None:
            continue
        assert f"[{data[field]['confidence']}]" in proc.stdout

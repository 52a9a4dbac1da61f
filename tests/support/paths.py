"""Where the tests' own files are."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
EVIDENCE = REPO / "tests" / "data" / "user_report_gloo_timeout.txt"  # the reporter's log, kept for CI on a clean clone
JOBS = REPO / "tests" / "jobs"  # one rank of a multi-process test job per script

"""Checks on a reproduction report, shared by the look-alike's tests and MOVA's."""


def assert_rank0_planned_while_the_peers_timed_out(report: dict) -> None:
    where = {int(rank): at for rank, at in report["where_at_timeout"].items()}  # JSON keys are strings
    assert where[0]["phase"] in ("gather: receive + unpickle plans", "global plan (rank 0)", "scatter")
    assert all(where[r]["phase"] == "waiting for plan (gather + scatter)" for r in range(1, 8))
    m = report["margins"]  # the deadline sits between what had to pass and the peers' wait for rank 0
    assert m["target_wait_s"] > m["deadline_s"] > m["must_pass_s"] and m["ratio"] >= 1.5

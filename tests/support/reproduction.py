"""Checks on a reproduction report, shared by the look-alike's tests and MOVA's."""

MODEL_SAVE, OPTIMIZER_SAVE = "pytorch_model_fsdp_0", "optimizer_0"


def assert_rank0_planned_while_the_peers_timed_out(report: dict) -> None:
    where = {int(rank): at for rank, at in report["where_at_timeout"].items()}  # JSON keys are strings
    assert where[0]["phase"] in ("gather: receive + unpickle plans", "global plan (rank 0)", "scatter")
    assert all(where[r]["phase"] == "waiting for plan (gather + scatter)" for r in range(1, 8))
    assert_the_deadline_sits_between_the_calibrations_own_waits(report)


def assert_the_deadline_sits_between_the_calibrations_own_waits(report: dict) -> None:
    """Against the raw waits the calibration run measured (not the margins the choice reports
    about itself, which `bounded()` makes consistent by construction): every wait that had to pass
    (the trainer's barrier, the model save's, and for the optimizer target the earlier parts of the
    optimizer save) stayed under the deadline, and every plan-scatter wait of the target save in
    the calibration reached past it, by 1.5x on both sides. Only for a first attempt: a retry moves
    the bounds past the calibration on purpose. (choose_deadline's rule, restated here as the oracle.)"""
    if len(report.get("attempts") or []) != 1 or not report.get("calibration"):
        return  # a retry, or a deadline given rather than calibrated
    cal, deadline = report["calibration"], report["deadline_ms"] / 1000
    model, optim = cal[MODEL_SAVE], cal[OPTIMIZER_SAVE]
    target = OPTIMIZER_SAVE if report["failed_call"] == "save_fsdp_optimizer" else MODEL_SAVE
    must_pass = [cal["barrier_wait_s"]] + [w["before_scatter_wait_s"] for w in model]
    if target == OPTIMIZER_SAVE:
        must_pass += [w["plan_scatter_wait_s"][1] for w in model] + [w["after_scatter_wait_s"] for w in model]
        must_pass += [w["before_scatter_wait_s"] for w in optim]
    target_waits = [w["plan_scatter_wait_s"][0] for w in cal[target]]
    assert max(must_pass) < deadline < min(target_waits), (max(must_pass), deadline, min(target_waits))
    assert min(target_waits) / max(must_pass) >= 1.5

from ckptdoctor.diagnose import callpath

REPORT_FRAMES = ["main", "train", "_save_checkpoint", "save_state", "save_fsdp_optimizer", "wrapper", "inner_func",
                 "save", "_save_state_dict", "reduce_scatter", "scatter_object", "wrapper", "scatter_object_list",
                 "wrapper", "broadcast"]


def test_the_reported_chain_is_an_optimizer_plan_scatter_broadcast():
    point = callpath.locate(REPORT_FRAMES)
    assert (point.operation, point.target, point.phase, point.waiting_call) == ("save", "optimizer", "plan-scatter", "broadcast")
    assert callpath.matches_report(REPORT_FRAMES)


def test_other_phases():
    gather = ["save_state", "save_fsdp_model", "save", "_save_state_dict", "reduce_scatter", "gather_object",
              "wrapper", "gather_object", "all_gather"]
    point = callpath.locate(gather)
    assert (point.target, point.phase, point.waiting_call) == ("model", "plan-gather", "all_gather")
    assert not callpath.matches_report(gather)
    finish = ["save", "_save_state_dict", "all_reduce", "broadcast_object", "broadcast_object_list", "broadcast"]
    assert callpath.locate(finish).phase == "finish-scatter"
    load = ["load_state", "load_fsdp_optimizer", "load", "_load_state_dict", "reduce_scatter", "scatter_object"]
    assert (callpath.locate(load).operation, callpath.locate(load).phase) == ("load", "plan-scatter")


def test_gloo_timeout_is_read_from_the_users_report(user_report_text):
    assert callpath.gloo_timeout_ms(user_report_text) == 1_800_000
    assert callpath.gloo_timeout_ms("Connection closed by peer") is None


def test_format_ranks_folds_runs():
    from ckptdoctor.ranks import format_ranks

    assert format_ranks([7, 1, 2, 3, 9, 10]) == "1-3,7,9-10"
    assert format_ranks([]) == "none"

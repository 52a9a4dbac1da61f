"""`ckptdoctor check`: before a launch, on a host of the job's image, rank 0's share of each
save at N ranks, stock and fixed, on torch's own planner code (product: no lab needed).

* ``layout``: the mesh a save runs on (fsdp, hsdp:S);
* ``state_dicts``: what a save receives: MOVA's parameters or an existing checkpoint's entries;
* ``mova_model``: MOVA's parameter structure (also the lab's training model);
* ``rank0``: one measurement of rank 0's phases, in one process, under torch's fake process group;
* ``cost_model``: the measurements at small N and the fits beyond;
* ``load_ranks``, ``load_cost_model``: the same for a resume (``check --load``);
* ``preflight``: the check itself, its warnings.
"""

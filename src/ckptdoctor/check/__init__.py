"""`ckptdoctor check`: before a launch, on a host of the job's image, rank 0's share of each
save at N ranks, stock and fixed, on torch's own planner code (product: no lab needed).

* ``layout``: the mesh a save runs on (fsdp, hsdp:S);
* ``state_dicts``: what a save receives: MOVA's parameters or an existing checkpoint's entries;
* ``mova_model``: MOVA's parameter structure (also the lab's training model);
* ``save_phases``, ``load_phases``: one measurement of a save's phases (rank 0's) or a load's (every
  rank's and rank 0's), in one process, under torch's fake process group (``fake_world``);
* ``jobs``: how a model runs one measurement in the interpreter it measures (the job kinds);
* ``save_model``, ``load_model``: the measurements at small N and the fits beyond (``fits``),
  for a save and for a resume (``check --load``); ``units`` writes their tables;
* ``host_copy_model``: what an async save stages on each rank at N (``check --async``): counted, not measured;
* ``preflight``: the check itself, its warnings.
"""

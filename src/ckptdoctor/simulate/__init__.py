"""The lab's side of the simulator: the product's cost model (check/save_model.py, rank 0's
share of a DCP save at N ranks on torch's own planner code, in one process) run in each pinned
stack's interpreter and plotted (``scaling``)."""

"""The lab's simulator: rank 0's share of a DCP save at N ranks, on torch's own planner code
in one process (``save``), driven across the pinned stacks with fits and plots (``scaling``)."""

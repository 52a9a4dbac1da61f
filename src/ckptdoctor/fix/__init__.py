"""The fix a training job imports: DCP's own extension points, nothing of the lab.

* ``planner.ScalableSavePlanner``: a DCP ``SavePlanner`` whose coordinator work does not
  grow with ranks x tensors;
* ``storage.ScalableFileSystemWriter``: a DCP ``FileSystemWriter`` whose finish step is
  columns, and which checks that what was written is what the metadata lists;
* ``checkpointing.ScalableCheckpointing``: Accelerate's ``save_state``/``load_state`` on a
  checkpoint group with the planner and writer, published atomically;
* ``watchdog.SaveWatchdog``: stacks and one summary line before a save's deadline passes. It
  lives here, not with the diagnosis tools, because it runs inside the training job.

Submodules are imported on first use (``import ckptdoctor.fix`` imports no torch).
"""

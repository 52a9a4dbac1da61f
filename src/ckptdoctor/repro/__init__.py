"""The lab that reproduces the save_state gloo timeout with real processes: a MOVA-shaped
model, a trainer on Accelerate's own FSDP2 path on CPU, a torchrun-like launcher, pass-through
probes, and the scaled-deadline reproduction (``reproduce``). Not needed by a training job."""

"""ckptdoctor: reproduce, explain and fix distributed-checkpoint hangs in FSDP2 + Accelerate."""

__version__ = "0.1.0"

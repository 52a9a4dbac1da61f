"""`ckptdoctor selftest`: the fix, checked on the user's own cluster under their own launcher.

    torchrun --nproc-per-node 8 [--nnodes ...] -m ckptdoctor selftest --dir /shared/ckpt-selftest
    accelerate launch --num_processes 8 -m ckptdoctor selftest --dir /shared/ckpt-selftest

Every rank builds a MOVA-shaped FSDP2 model through Accelerate on the job's device (NPU with
torch_npu, CUDA, else CPU) and backend ("cpu:gloo,npu:hccl", "cpu:gloo,cuda:nccl" or "gloo"),
takes optimizer steps, saves through `ScalableCheckpointing`, and loads it back with the fix and
with stock Accelerate/DCP; each rank's checksum of its shards (parameters and optimizer state)
must match what it saved. Around that it checks what the cluster decides: the directory on
every rank, directory fsync, mtime granularity, free space, open-file limit against the sockets
the checkpoint group needs, the store's capacity against the heartbeats' load, the checkpoint
group's creation time, and that the published step is visible on every rank. With `--stock`,
it also times stock DCP's plan exchange on the same state, on a group with its own long deadline.

Rank 0 prints one screen of verdicts and writes JSON; every rank exits 0 only when every check
passed (1 otherwise, 2 for bad input). Modules: `backend` (launcher, backend, device), `model`,
`checks` (the cluster's file system and limits), `roundtrip` (save and loads), `run` (the order
of work and the report), `accelerate_cpu` (Accelerate's FSDP path on CPU-only hosts).
"""

"""Tensor parallelism over torch.distributed: one model split across ranks, Megatron-style.

- `shard.py`   which rows and columns of each weight a rank owns, and the all-reduce after the
               row-parallel linears (o_proj, down_proj);
- `group.py`   the process group: backend (shm or gloo on CPU, NCCL on CUDA), address and free port;
- `shm.py`     the shared-memory all-reduce for CPU ranks that are processes on one host;
- `worker.py`  a worker rank: builds its shard and runs each step's forward as rank 0 sends it;
- `executor.py` rank 0's side: launches the workers, sends each step, shuts them down;
- `ray_workers.py` the worker ranks as Ray actors, for an engine inside a Ray Serve replica.

docs/tensor_parallel.md describes the design and what was measured.
"""

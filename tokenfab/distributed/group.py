"""The tensor-parallel process group: which backend, where to meet, how long to wait.

gloo on CPU (and what the tests run: 2 local processes), NCCL on CUDA, where rank r drives cuda:r.
Ranks meet at MASTER_ADDR:MASTER_PORT: the environment's values when set, else 127.0.0.1 and a port
the OS says is free (picked by rank 0 and handed to the workers, which see it in their environment too).
"""
from __future__ import annotations

import os
import socket
from datetime import timedelta

import torch

# How long one all-reduce may wait for the other ranks. A dead rank is noticed at once (its sockets
# close); this bounds the wait on a rank that hangs without dying, and must exceed the slowest step.
COLLECTIVE_TIMEOUT = timedelta(seconds=float(os.environ.get("TOKENFAB_TP_TIMEOUT", "600")))


def backend_for(device: str) -> str:
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def rank_device(device: str, rank: int) -> str:
    """Rank r's device: cuda:r on CUDA (one GPU per rank), the CPU otherwise."""
    return f"cuda:{rank}" if torch.device(device).type == "cuda" else device


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def rendezvous() -> tuple[str, int]:
    """(address, port) for this group: MASTER_ADDR / MASTER_PORT if set, else localhost and a free port."""
    addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
    port = os.environ.get("MASTER_PORT")
    return addr, int(port) if port else free_port()


def init_group(device: str, rank: int, size: int, addr: str, port: int) -> None:
    import torch.distributed as dist
    if dist.is_initialized():
        raise RuntimeError("a torch.distributed process group already exists in this process; one "
                           "tensor-parallel engine per process (close the other one first: LLM.close())")
    if backend_for(device) == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend_for(device), init_method=f"tcp://{addr}:{port}", rank=rank,
                            world_size=size, timeout=COLLECTIVE_TIMEOUT)


def destroy_group() -> None:
    import torch.distributed as dist
    if dist.is_initialized():
        dist.destroy_process_group()

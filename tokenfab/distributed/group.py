"""The tensor-parallel process group: which backend, where the ranks meet, how long they wait.

How the ranks add their partial sums (`allreduce_backend`, the `tp_allreduce` knob):
- **shm** (shm.py) for CPU ranks that are local processes on x86-64: a buffer they all map, the
  default there (`auto`);
- **gloo** for other CPU ranks (Ray actors, other architectures) or when asked for;
- **nccl** on CUDA, where rank r drives cuda:r.
For gloo and NCCL each engine makes its own group object (`ProcessGroupGloo` / `ProcessGroupNCCL` over a
TCPStore, wrapped in `DistGroup`) and passes it to every collective; nothing goes through
torch.distributed's global default group, so several tensor-parallel engines can live in one process
and closing one leaves no global state.

Rank 0 hosts the store at MASTER_ADDR:MASTER_PORT when those are set, else on 127.0.0.1 and a port the
OS picks while binding (so no other process can take it between picking and binding); the workers
get the address and port from rank 0 and see them as MASTER_ADDR / MASTER_PORT in their environment.
"""
from __future__ import annotations

import os
import platform
from datetime import timedelta

import torch
import torch.distributed as dist

# How long one collective may wait for the other ranks. A dead rank is noticed at once (its sockets
# close); this bounds the wait on a rank that hangs without dying, so it must exceed the slowest step.
COLLECTIVE_TIMEOUT = timedelta(seconds=float(os.environ.get("TOKENFAB_TP_TIMEOUT", "600")))


def backend_for(device: str) -> str:
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def allreduce_backend(config, launcher: str) -> str:
    """"shm", "gloo" or "nccl": NCCL on CUDA; on the CPU `config.tp_allreduce`, where auto is shm for
    ranks launched as local processes ("mp") on x86-64 and gloo otherwise (Ray actors get their
    arguments by value, so they cannot be handed the shared buffer). ValueError for a choice that
    cannot run here."""
    from tokenfab.distributed import shm
    choice = config.tp_allreduce
    if backend_for(config.device) == "nccl":
        if choice != "auto":
            raise ValueError(f"tp_allreduce={choice!r} is for CPU ranks; on CUDA the ranks use NCCL: leave it auto")
        return "nccl"
    if choice == "auto":
        return "shm" if launcher == "mp" and shm.supported() else "gloo"
    if choice == "shm" and launcher != "mp":
        raise ValueError("tp_allreduce='shm' needs the ranks launched as local processes "
                         "(distributed_executor_backend='mp'); Ray actor ranks use gloo")
    if choice == "shm" and not shm.supported():
        raise ValueError(f"tp_allreduce='shm' relies on x86-64 memory ordering; this machine is "
                         f"{platform.machine()}: use gloo")
    return choice


class DistGroup:
    """A torch.distributed process group behind the same `all_reduce` as shm.ShmGroup."""

    def __init__(self, pg):
        self.pg = pg

    def all_reduce(self, y: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(y, group=self.pg)
        return y

    def abort(self) -> None:
        """Nothing to flag: a stopped peer's sockets close, which fails a pending all-reduce."""


def rank_device(device: str, rank: int) -> str:
    """Rank r's device: cuda:r on CUDA (one GPU per rank), the CPU otherwise."""
    return f"cuda:{rank}" if torch.device(device).type == "cuda" else device


def host_store(size: int) -> tuple[dist.TCPStore, str, int]:
    """Rank 0's rendezvous store and where it listens."""
    addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
    port = int(os.environ.get("MASTER_PORT") or 0)
    store = dist.TCPStore(addr, port, size, is_master=True, timeout=COLLECTIVE_TIMEOUT, wait_for_workers=False)
    return store, addr, store.port


def join_store(addr: str, port: int, size: int) -> dist.TCPStore:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = addr, str(port)
    return dist.TCPStore(addr, port, size, is_master=False, timeout=COLLECTIVE_TIMEOUT)


def make_group(store: dist.TCPStore, device: str, rank: int, size: int, cuda_index: int | None = None) -> DistGroup:
    """This rank's process group; returns once every rank has joined (or raises at the timeout).
    `cuda_index`: this rank's GPU where it is not cuda:rank (a Ray actor sees only its own, as cuda:0)."""
    if backend_for(device) == "nccl":       # untested here (no GPU): one device per rank
        torch.cuda.set_device(rank if cuda_index is None else cuda_index)
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = COLLECTIVE_TIMEOUT
        return DistGroup(dist.ProcessGroupNCCL(store, rank, size, opts))
    return DistGroup(dist.ProcessGroupGloo(store, rank, size, COLLECTIVE_TIMEOUT))

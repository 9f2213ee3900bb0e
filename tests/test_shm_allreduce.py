"""The shared-memory all-reduce (tokenfab/distributed/shm.py) between this process (rank 0) and a
spawned rank 1: sums every size and dtype exactly, bitwise alike on both ranks, in chunks past one
slot; a dead peer or a stopped group is an error, never a hang; and which backend a config gets."""
import os

import pytest
import torch

from tokenfab.config import EngineConfig
from tokenfab.distributed import group, shm

SLOT = 256          # bytes: small, so the bigger messages below go in several chunks
CASES = [(torch.float32, 1), (torch.float32, 63), (torch.float32, 64), (torch.float32, 1000),
         (torch.bfloat16, 300), (torch.float16, 129), (torch.int64, 77), (torch.float32, 0)]


def _partial(rank: int, dtype: torch.dtype, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + n)
    if dtype.is_floating_point:
        return (torch.randn(n, generator=g) * 3).to(dtype)
    return torch.randint(-1000, 1000, (n,), generator=g, dtype=dtype)


def _rank1_sums(buf, out) -> None:
    g = shm.ShmGroup(buf, 1, 2, slot_bytes=SLOT, timeout_s=60)
    # as bytes: a tensor put on a queue is shared, and this process is gone by the time it is read
    out.put([g.all_reduce(_partial(1, dtype, n)).view(torch.uint8).numpy().tobytes() for dtype, n in CASES])


def _rank1_exits(buf) -> None:
    shm.ShmGroup(buf, 1, 2, slot_bytes=SLOT)
    os._exit(0)         # attached, then gone before the all-reduce


def _spawn(target, *args):
    p = torch.multiprocessing.get_context("spawn").Process(target=target, args=args, daemon=True)
    p.start()
    return p


def test_two_ranks_get_bitwise_identical_exact_sums_for_every_size_and_dtype():
    buf = shm.allocate(2, SLOT)
    q = torch.multiprocessing.get_context("spawn").Queue()
    p = _spawn(_rank1_sums, buf, q)
    g = shm.ShmGroup(buf, 0, 2, slot_bytes=SLOT, pids=[os.getpid(), p.pid], timeout_s=60)
    mine = [g.all_reduce(_partial(0, dtype, n)) for dtype, n in CASES]
    theirs = [torch.frombuffer(bytearray(b), dtype=dtype) if b else torch.zeros(0, dtype=dtype)
              for b, (dtype, _) in zip(q.get(timeout=60), CASES)]
    p.join(30)
    assert p.exitcode == 0
    for (dtype, n), a, b in zip(CASES, mine, theirs):
        want = _partial(0, dtype, n) + _partial(1, dtype, n)        # rank 0's partial first, as shm adds them
        assert a.dtype == b.dtype == dtype and a.shape == (n,)
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), (dtype, n)     # the same bits
        assert torch.equal(a, want), (dtype, n)
    # one round per slot-sized chunk (an empty tensor still meets its peers once)
    assert g.seq == sum(max(1, -(-n * torch.tensor([], dtype=d).element_size() // SLOT)) for d, n in CASES)


def test_a_peer_that_exits_makes_the_all_reduce_raise_instead_of_hanging():
    buf = shm.allocate(2, SLOT)
    p = _spawn(_rank1_exits, buf)
    g = shm.ShmGroup(buf, 0, 2, slot_bytes=SLOT, pids=[os.getpid(), p.pid], timeout_s=600)
    p.join(60)          # exited, not yet reaped by multiprocessing: a zombie counts as gone
    with pytest.raises(RuntimeError, match=rf"rank 1 \(pid {p.pid}\) exited"):
        g.all_reduce(torch.ones(8))


def test_a_peer_past_the_timeout_or_a_stopped_group_raises():
    # the peer "is" this process: alive, but it never arrives
    g = shm.ShmGroup(shm.allocate(2, SLOT), 0, 2, slot_bytes=SLOT, pids=[os.getpid()] * 2, timeout_s=0.0)
    with pytest.raises(RuntimeError, match=r"rank\(s\) 1 did not arrive within 0 s \(TOKENFAB_TP_TIMEOUT\)"):
        g.all_reduce(torch.ones(8))
    g = shm.ShmGroup(shm.allocate(2, SLOT), 0, 2, slot_bytes=SLOT, pids=[os.getpid()] * 2, timeout_s=600)
    g.abort()           # what rank 0 does when the group stops; every rank sees it
    with pytest.raises(RuntimeError, match="group was stopped"):
        g.all_reduce(torch.ones(8))


def test_slot_size_must_be_whole_cache_lines():
    with pytest.raises(ValueError, match="slot_bytes must be a positive multiple of 64, got 100"):
        shm.allocate(2, 100)


def test_tp_allreduce_knob_picks_shm_for_local_cpu_processes_and_refuses_what_cannot_run(monkeypatch):
    monkeypatch.setattr(shm, "supported", lambda: True)
    auto = EngineConfig(tensor_parallel_size=2)
    assert auto.tp_allreduce == "auto"
    assert group.allreduce_backend(auto, "mp") == "shm"
    assert group.allreduce_backend(auto, "ray") == "gloo"         # Ray actors cannot be handed the buffer
    assert group.allreduce_backend(EngineConfig(tp_allreduce="gloo"), "mp") == "gloo"
    assert group.allreduce_backend(EngineConfig(device="cuda"), "mp") == "nccl"
    with pytest.raises(ValueError, match="tp_allreduce='shm' needs the ranks launched as local processes"):
        group.allreduce_backend(EngineConfig(tp_allreduce="shm"), "ray")
    with pytest.raises(ValueError, match="on CUDA the ranks use NCCL: leave it auto"):
        group.allreduce_backend(EngineConfig(device="cuda", tp_allreduce="shm"), "mp")
    monkeypatch.setattr(shm, "supported", lambda: False)
    assert group.allreduce_backend(auto, "mp") == "gloo"
    with pytest.raises(ValueError, match="relies on x86-64 memory ordering"):
        group.allreduce_backend(EngineConfig(tp_allreduce="shm"), "mp")
    with pytest.raises(ValueError, match="tp_allreduce must be auto, shm or gloo, got 'mpi'"):
        EngineConfig(tensor_parallel_size=2, tp_allreduce="mpi").validate()

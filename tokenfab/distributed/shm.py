"""The shared-memory all-reduce: tensor-parallel ranks that are processes on one host add their partial
sums through one buffer they all map, instead of gloo's loopback TCP.

Why: on the 2-core dev VM a gloo all-reduce of a decode step's 2-16 KiB cost ~0.9 ms inside a step
(~0.3 ms in a tight loop) and moved 30 % between quiet runs (docs/tensor_parallel.md). Here an
all-reduce is a copy, a flag, a wait and an add, all in this process.

The buffer is one shared uint8 tensor, made by rank 0 before the workers are spawned (`allocate`) and
handed to them as a spawn argument: torch shares its storage, which is freed when the last rank lets
go of it, killed or not. Layout:
- header: one 64-byte line per rank, [sequence number, pid], then one line whose first word is the
  abort flag;
- data: per rank two slots of `slot_bytes` (double buffering by the sequence number's parity).

An all-reduce goes in chunks of at most `slot_bytes`. For each chunk, with this rank's next sequence
number s:
1. copy my partial into my slot s % 2, then publish seq[me] = s;
2. wait until every peer's seq is at least s;
3. add the slots s % 2 of ranks 0, 1, ..., t-1, in that order, into the output.
Every rank adds the same numbers in the same order, so every rank gets bitwise the same result. Two
slots are enough: a peer is at most one chunk ahead (at s + 1 it waits for my s + 1), and it writes
slot s % 2 again only at s + 2, after every rank has published s + 1, i.e. finished reading at s.

Ordering: the flag is an aligned 8-byte store after the data copy, and a reader loads the flag before
the data. x86-64 keeps stores in order and loads in order (TSO), which this relies on: `supported()`
is x86-64 only, and elsewhere the ranks use gloo.

Waiting spins a little, then yields the core (`os.sched_yield`), then sleeps 50 µs at a time: on two
cores a waiting rank must not starve the rank it waits for. Every 50 ms of waiting it checks the abort
flag (rank 0 sets it when the group stops), that every peer's process is alive, and the timeout
(TOKENFAB_TP_TIMEOUT, as for gloo): a dead peer is an error, never a hang.
"""
from __future__ import annotations

import os
import platform
import time

import torch

from tokenfab.distributed.group import COLLECTIVE_TIMEOUT

LINE = 64                   # bytes per header line: one cache line, so ranks' flags never share one
WORDS = LINE // 8           # int64 words per line
SLOT_BYTES = 1 << 20        # per rank and parity; bigger messages (prefill) go in chunks
SPIN_S = 50e-6              # busy-wait this long before yielding the core ...
YIELD_S = 2e-3              # ... yield until this long, then sleep SLEEP_S at a time
SLEEP_S = 50e-6
CHECK_S = 0.05              # how often a wait looks for a dead peer, the abort flag and the timeout


def supported() -> bool:
    """Whether this machine keeps the store and load order the protocol relies on (x86-64)."""
    return platform.machine().lower() in ("x86_64", "amd64")


def buffer_bytes(size: int, slot_bytes: int = SLOT_BYTES) -> int:
    return LINE * (size + 1) + 2 * size * slot_bytes


def allocate(size: int, slot_bytes: int = SLOT_BYTES) -> torch.Tensor:
    """The zeroed shared buffer for a group of `size` ranks (rank 0 makes it before spawning the others)."""
    if slot_bytes <= 0 or slot_bytes % LINE:
        raise ValueError(f"slot_bytes must be a positive multiple of {LINE}, got {slot_bytes}")
    return torch.zeros(buffer_bytes(size, slot_bytes), dtype=torch.uint8).share_memory_()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:     # someone else's process: it exists
        return True
    try:                        # an exited child its parent has not reaped yet is gone too
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except OSError:
        return True             # no /proc: os.kill said it exists


class ShmGroup:
    """One rank's view of the shared buffer: `all_reduce(tensor)` sums in place across the ranks."""

    def __init__(self, buf: torch.Tensor, rank: int, size: int, slot_bytes: int = SLOT_BYTES,
                 pids: list[int] | None = None, timeout_s: float | None = None):
        assert buf.dtype == torch.uint8 and buf.is_shared() and buf.numel() == buffer_bytes(size, slot_bytes)
        self.rank, self.size, self.slot_bytes = rank, size, slot_bytes
        self.timeout_s = COLLECTIVE_TIMEOUT.total_seconds() if timeout_s is None else timeout_s
        self.buf = buf
        self.header = buf[:LINE * (size + 1)].view(torch.int64).numpy()
        data = buf[LINE * (size + 1):]
        # slots[parity][rank]
        self.slots = [[data[(2 * r + k) * slot_bytes:(2 * r + k + 1) * slot_bytes] for r in range(size)]
                      for k in range(2)]
        self._views: dict[tuple, tuple] = {}      # (dtype, shape) -> per parity, each rank's slot as that tensor
        self.seq = int(self.header[rank * WORDS])      # 0 on a fresh buffer
        for r, pid in enumerate(pids or []):            # rank 0 knows every pid before the workers attach
            self.header[r * WORDS + 1] = pid
        self.header[rank * WORDS + 1] = os.getpid()
        self._flag = rank * WORDS
        self._peer_flags = tuple(p * WORDS for p in range(size) if p != rank)

    def all_reduce(self, y: torch.Tensor) -> torch.Tensor:
        """Sum `y` (contiguous, on the CPU) over the ranks, in place; every rank gets the same bits."""
        if y.numel() * y.element_size() <= self.slot_bytes:
            return self._reduce(y)
        flat = y.view(-1)
        per = self.slot_bytes // y.element_size()
        for start in range(0, flat.numel(), per):
            self._reduce(flat[start:start + per])
        return y

    def _reduce(self, y: torch.Tensor) -> torch.Tensor:
        """One chunk. Kept to a handful of tensor calls: at a decode step's sizes the Python around them
        is most of the cost (the slot views are made once per shape)."""
        key = (y.dtype, y.shape)
        views = self._views.get(key)
        if views is None:
            if len(self._views) > 4096:         # every token count a step ever had: start again
                self._views.clear()
            nbytes = y.numel() * y.element_size()
            views = self._views[key] = tuple(tuple(s[:nbytes].view(y.dtype).view(y.shape) for s in parity)
                                             for parity in self.slots)
        self.seq = s = self.seq + 1
        slots = views[s & 1]
        slots[self.rank].copy_(y)
        self.header[self._flag] = s         # publish: after the data (x86 store order)
        header = self.header
        for i in self._peer_flags:
            if header[i] < s:
                self._wait(s)
                break
        torch.add(slots[0], slots[1], out=y)        # in rank order, the same on every rank
        for x in slots[2:]:
            y.add_(x)
        return y

    def _wait(self, s: int) -> None:
        header = self.header
        pending = [i // WORDS for i in self._peer_flags]
        t0 = time.perf_counter()
        next_check = t0 + CHECK_S
        while True:
            pending = [p for p in pending if header[p * WORDS] < s]
            if not pending:
                return
            now = time.perf_counter()
            if now - t0 < SPIN_S:
                continue
            if now >= next_check:
                self._check(pending, now - t0)
                next_check = now + CHECK_S
            if now - t0 < YIELD_S:
                os.sched_yield()
            else:
                time.sleep(SLEEP_S)

    def _check(self, pending: list[int], waited_s: float) -> None:
        """Raise when the wait cannot end: the group was stopped, a peer died, or the timeout passed."""
        if self.header[self.size * WORDS]:
            raise RuntimeError("shared-memory all-reduce: the tensor-parallel group was stopped")
        for p in pending:
            pid = int(self.header[p * WORDS + 1])
            if pid and not _pid_alive(pid):
                raise RuntimeError(f"shared-memory all-reduce: rank {p} (pid {pid}) exited")
        if waited_s > self.timeout_s:
            raise RuntimeError(f"shared-memory all-reduce: rank(s) {', '.join(map(str, pending))} did not arrive "
                               f"within {self.timeout_s:.0f} s (TOKENFAB_TP_TIMEOUT)")

    def abort(self) -> None:
        """Make every rank's current and next wait raise (rank 0 does this when the group stops)."""
        self.header[self.size * WORDS] = 1

"""A worker rank (1 .. t-1): build this rank's shard with the same Worker as rank 0 (worker/worker.py),
then run every step rank 0 sends, until told to stop.

Rank 0 owns the scheduler, the block tables and the sampler. Each step it sends the flat batch (token
ids, positions, slot mapping, decode block tables and context lengths, prefill chunks: `encode_step`)
down a pipe to every worker, then runs its own forward; the ranks meet in the all-reduces. Workers ask
for no logits (the LM head runs on rank 0 only). Because every rank gets the same slot mapping and
block tables, the KV blocks mean the same positions on every rank; each rank's pool holds its KV heads.

A pipe rather than a collective carries the step: an idle server then costs nothing (a collective
waiting for the next step would time out), and a worker notices at once when rank 0's process is gone
(the pipe closes), as well as by polling its parent's pid while it loads.
"""
from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
import traceback

import numpy as np
import torch


STOP = "stop"


def encode_step(step, with_logits: bool = False) -> tuple:
    """A StepInput as plain numpy arrays and ints (cheap to pickle; no shared-memory tensors)."""
    m = step.meta
    arr = lambda t: None if t is None else t.cpu().numpy()     # noqa: E731
    prefills = [(p.query_start, p.query_len, p.context_len, arr(p.block_table)) for p in m.prefills]
    return ("step", arr(step.input_ids), arr(step.positions), arr(m.slot_mapping), m.num_decode_tokens,
            arr(m.decode_block_tables), arr(m.decode_context_lens), m.decode_max_context, prefills,
            arr(step.logits_indices) if with_logits else np.zeros(0, dtype=np.int64))


def decode_step(msg: tuple, device: str):
    """The worker's StepInput for a message from encode_step (sampling fields empty: workers don't sample)."""
    from tokenfab.worker.model_runner import StepInput
    from tokenfab.model.attention import AttentionMetadata, PrefillChunk

    _, ids, pos, slots, nd, dbt, dln, dmax, prefills, logits_idx = msg
    t = lambda a: None if a is None else torch.from_numpy(a).to(device)     # noqa: E731
    positions = t(pos)
    meta = AttentionMetadata(slot_mapping=t(slots), num_decode_tokens=nd, decode_block_tables=t(dbt),
                             decode_context_lens=t(dln), decode_max_context=dmax,
                             prefills=[PrefillChunk(qs, ql, cl, t(bt)) for qs, ql, cl, bt in prefills],
                             positions=positions)
    return StepInput(t(ids), positions, meta, t(logits_idx), [], [])


def _watch_parent(parent_pid: int) -> None:
    """Exit when the process that started us is gone (killed, crashed): no orphan ranks."""
    while True:
        if os.getppid() != parent_pid:
            os._exit(3)
        time.sleep(0.5)


def load_rank(rank: int, config, kv, device: str | None = None):
    """Build rank `rank`'s Worker over rank 0's KV sizing `kv` (what every launcher's worker does first),
    allocate its KV pool, and return it with its device. `device`: this rank's device where the launcher
    decides it (a Ray actor sees only its own GPU, as cuda:0)."""
    from tokenfab.distributed.group import rank_device
    from tokenfab.worker.worker import Worker

    device = device or rank_device(config.device, rank)
    worker = Worker(config, rank, kv=kv, device=device)
    worker.init_kv_cache()
    return worker, device


def worker_main(rank: int, config, kv, num_threads: int, conn, parent_pid: int,
                shared: torch.Tensor | None = None) -> None:
    """Entry point of a spawned worker rank: `config` is rank 0's rank config (naming the model files),
    `kv` its KV sizing (worker.KVCacheSpec). Reports "ok" or an error string on `conn` once loaded, then
    waits for ("init", address, port) to join the group at rank 0's store, or ("init", None, None) to
    join the shared-memory all-reduce on `shared` (shm.py)."""
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    # Ctrl-C reaches the whole process group: rank 0 decides when to stop (the server drains its
    # requests first, which needs the workers), so a worker ignores it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=logging.WARNING, format=f"tokenfab rank {rank}: %(levelname)s %(message)s")
    torch.set_num_threads(num_threads)
    from tokenfab.distributed.group import join_store, make_group
    from tokenfab.distributed.shm import ShmGroup
    try:
        worker, device = load_rank(rank, config, kv)
    except BaseException as e:      # noqa: BLE001 - reported to rank 0, which raises it for the user
        conn.send(f"rank {rank} failed to load: {type(e).__name__}: {e}")
        return
    conn.send("ok")
    try:
        msg = conn.recv()
    except (EOFError, OSError):
        return
    if msg[0] != "init":
        return
    size = config.tensor_parallel_size
    if msg[1] is None:
        worker.model.tp_comm.group = ShmGroup(shared, rank, size)
    else:
        worker.model.tp_comm.group = make_group(join_store(msg[1], msg[2], size), config.device, rank, size)
    try:
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):    # rank 0 is gone
                break
            if msg == STOP:
                break
            worker.execute(decode_step(msg, device))
    except BaseException:       # noqa: BLE001 - a peer died or our forward failed: say so, then exit
        traceback.print_exc(file=sys.stderr)
        os._exit(1)
    finally:
        conn.close()

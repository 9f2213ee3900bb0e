"""Rank 0's side of tensor parallelism: build rank 0's Worker, launch the worker ranks, send them each
step, shut them down.

    executor = TensorParallelExecutor(config)      # rank 0's shard, kernels and KV sizing (worker/worker.py)
    executor.init_kv_cache()                       # rank 0's pool; ranks 1..t-1 load theirs and join

Every rank runs the same Worker on a per-rank config (`rank_config`: the caller's config is left as it
is) and allocates the KV pool rank 0 sized (`KVCacheSpec`: dtype, blocks, longest sequence).
`TensorParallelRunner` is a ModelRunner (same `prepare`, same KV pool for rank 0's heads) whose
`execute` first sends the step to the workers (worker.py). The workers are `torch.multiprocessing`
spawn processes (a clean interpreter each: no forked OpenMP or torch state), or Ray actors when the
engine itself runs in a Ray actor (a `serve --replicas` replica; ray_workers.py): `choose_launcher`.
Shutdown is explicit (`close()`: LLM.close, AsyncEngine.stop) and also happens when the engine is
garbage-collected or the interpreter exits; workers exit on their own when rank 0's process dies.
A failure on any rank (a worker killed, a forward raising) ends the group: the step raises, every
later step raises the same RuntimeError, and the workers are stopped; the engine must be recreated.
"""
from __future__ import annotations

import logging
import os
import sys
import time
import weakref
from dataclasses import replace

import torch

from tokenfab.distributed import group, shm
from tokenfab.distributed.worker import STOP, encode_step, worker_main
from tokenfab.worker.model_runner import ModelRunner
from tokenfab.worker.worker import KVCacheSpec, Worker

log = logging.getLogger("tokenfab.distributed")

LOAD_TIMEOUT_S = float(os.environ.get("TOKENFAB_TP_LOAD_TIMEOUT", "900"))


def rank_config(config):
    """The config every rank builds with (a copy; the caller's is unchanged), after clearing errors for
    what tensor parallelism does not combine with yet: the one-call C decode stack off (it has no
    all-reduce between layers: the layers run one by one, each with the cpu backend's C attention and
    norms where it applies)."""
    if config.speculative_config is not None:
        raise ValueError("speculative decoding does not run with tensor_parallel_size > 1 yet; drop one of them")
    if torch.device(config.device).type == "cuda" and choose_launcher(config) == "mp" \
            and torch.cuda.device_count() < config.tensor_parallel_size:     # a Ray actor sees only its own GPU
        raise ValueError(f"tensor_parallel_size {config.tensor_parallel_size} needs as many GPUs; "
                         f"{torch.cuda.device_count()} visible")
    group.allreduce_backend(config, choose_launcher(config))      # a tp_allreduce that cannot run here
    return replace(config, enable_fused_decode=False)


class TensorParallelExecutor:
    """The engine's executor for tensor_parallel_size > 1 (worker/executor.py names the surface)."""

    def __init__(self, config, loaded=None, speculative=None):
        self.config = rank_config(config)
        torch.set_num_threads(threads_per_rank(config))       # rank 0's share of the cores
        self.worker = Worker(self.config, loaded=loaded, speculative=speculative)
        self.runner: TensorParallelRunner | None = None

    def init_kv_cache(self, sliding=None) -> None:
        """Rank 0's pool, then ranks 1..t-1 (each loads its shard and allocates rank 0's `kv`)."""
        runner = self.worker.init_kv_cache(sliding)
        self.runner = TensorParallelRunner.start(replace(self.config, model=self.worker.model_path), runner,
                                                 self.worker.kv)

    def close(self) -> None:
        if self.runner is not None:
            self.runner.close()


LAUNCHERS = ("mp", "ray")


def in_ray_actor() -> bool:
    """Whether this process is a Ray actor (a Serve replica). Never imports Ray just to ask."""
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return False
    try:
        return ray.get_runtime_context().get_actor_id() is not None
    except Exception:       # noqa: BLE001 - an old or half-initialised Ray: not an actor we can use
        return False


def choose_launcher(config, inside_ray_actor: bool | None = None) -> str:
    """How the worker ranks start: `distributed_executor_backend` when set (vLLM's name: "mp" or
    "ray"), else Ray actors inside a Ray actor (so Ray sees, places and accounts for every rank of a
    replica, and they die with it) and torch.multiprocessing everywhere else."""
    b = config.distributed_executor_backend
    if b is not None:
        if b not in LAUNCHERS:
            raise ValueError(f"distributed_executor_backend must be one of {', '.join(LAUNCHERS)}, got {b!r}")
        return b
    return "ray" if (in_ray_actor() if inside_ray_actor is None else inside_ray_actor) else "mp"


def threads_per_rank(config) -> int:
    """Each rank's torch threads: num_threads if given, else the cores split evenly between ranks
    (two ranks each spinning on every core slow each other down)."""
    return config.num_threads or max(1, (os.cpu_count() or 1) // config.tensor_parallel_size)


class _Workers:
    """The worker processes and their pipes. Kept apart from the runner so the finalizer that stops
    them holds no reference to the engine. Ray's counterpart: ray_workers.RayWorkers."""

    def __init__(self):
        self.procs, self.conns = [], []
        self.store = None       # rank 0's rendezvous store: kept for the group's lifetime

    def launch(self, config, kv: KVCacheSpec, threads: int, shared: torch.Tensor | None = None) -> None:
        """Start ranks 1..t-1 and wait until each has loaded its shard (RuntimeError naming the rank if not).
        `shared`: the shared-memory all-reduce's buffer (shm.allocate), handed to each rank at spawn."""
        ctx = torch.multiprocessing.get_context("spawn")
        for rank in range(1, config.tensor_parallel_size):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=worker_main, name=f"tokenfab-tp{rank}", daemon=True,
                            args=(rank, config, kv, threads, child, os.getpid(), shared))
            p.start()
            child.close()
            self.procs.append(p)
            self.conns.append(parent)
        for rank, (p, c) in enumerate(zip(self.procs, self.conns), start=1):
            status = _wait_ready(p, c, rank)
            if status != "ok":
                raise RuntimeError(f"tensor parallelism: {status}")

    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def join(self, addr: str | None, port: int | None) -> None:
        """Tell the ranks to form their group: at rank 0's store, or (None) on the buffer they were given."""
        for c in self.conns:
            c.send(("init", addr, port))

    def joined(self) -> None:
        """Rank 0 has its group, so every worker has its own (make_group returns only once all have met)."""

    def send(self, msg) -> None:
        for c in self.conns:
            c.send(msg)

    def dead(self) -> list[str]:
        return [p.name for p in self.procs if not p.is_alive()]

    def stop(self, timeout: float = 10.0) -> None:
        for c in self.conns:
            try:
                c.send(STOP)
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + timeout
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in self.procs:            # still there: terminate, then kill
            if p.is_alive():
                p.terminate()
                p.join(2)
            if p.is_alive():
                p.kill()
                p.join(2)
        for c in self.conns:
            c.close()
        self.procs, self.conns = [], []
        self.store = None


class TensorParallelRunner(ModelRunner):
    """Rank 0's ModelRunner: sends each step to the worker ranks, then runs its own shard."""

    @classmethod
    def start(cls, config, runner: ModelRunner, kv: KVCacheSpec) -> "TensorParallelRunner":
        """Launch ranks 1..t-1 (`config`: the rank config, naming the model files rank 0 read), wait until
        each has loaded its shard, then form the process group. Raises RuntimeError naming the rank and
        its error when a worker cannot load."""
        self = cls.__new__(cls)
        self.__dict__.update(runner.__dict__)     # rank 0's model and KV pool, built by its Worker
        self.size = size = config.tensor_parallel_size
        self.error: str | None = None
        self.launcher = choose_launcher(config)
        if self.launcher == "ray":
            from tokenfab.distributed.ray_workers import RayWorkers
            workers = RayWorkers()
        else:
            workers = _Workers()
        self.workers = workers
        self._finalizer = weakref.finalize(self, workers.stop)
        threads = threads_per_rank(config)
        self.allreduce = group.allreduce_backend(config, self.launcher)
        shared = shm.allocate(size) if self.allreduce == "shm" else None
        try:
            workers.launch(config, kv, threads, shared)
            if shared is not None:
                where = "shared memory"
                self.model.tp_comm.group = shm.ShmGroup(shared, 0, size, pids=[os.getpid(), *workers.pids()])
                workers.join(None, None)            # every pid is in the buffer before a worker waits on it
            else:
                store, addr, port = group.host_store(size)
                where = f"{addr}:{port}"
                workers.join(addr, port)
                self.model.tp_comm.group = group.make_group(store, config.device, 0, size)
                workers.joined()
                workers.store = store
        except BaseException:
            workers.stop(timeout=2)
            raise
        log.info("tensor parallelism: %d ranks (%s all-reduce, %s; %s workers), %d threads each", size,
                 self.allreduce, where, self.launcher, threads)
        return self

    def execute(self, step) -> torch.Tensor:
        if self.error is not None:
            raise RuntimeError(self.error)
        try:
            self.workers.send(encode_step(step))
            return super().execute(step)
        except BaseException as e:
            dead = self.workers.dead()
            self.error = (f"tensor-parallel group stopped: {type(e).__name__}: {e}"
                          + (f" (worker {', '.join(dead)} exited)" if dead else "")
                          + "; the engine must be recreated")
            self.close(timeout=2)              # a worker may wait in an all-reduce rank 0 never joins
            raise RuntimeError(self.error) from e

    def close(self, timeout: float = 10.0) -> None:
        """Stop the workers (terminated after `timeout` s) and drop the process group; idempotent. A
        worker waiting in an all-reduce is released by the abort flag (shm) or by being terminated."""
        g, self.model.tp_comm.group = self.model.tp_comm.group, None
        if g is not None:
            g.abort()
        if self._finalizer.detach() is not None:
            self.workers.stop(timeout)

    @property
    def comm(self):
        """Rank 0's process group and all-reduce counters (shard.Comm)."""
        return self.model.tp_comm


def _wait_ready(proc, conn, rank: int) -> str:
    """The worker's load status ("ok" or its error), or why it never came."""
    deadline = time.monotonic() + LOAD_TIMEOUT_S
    while time.monotonic() < deadline:
        if conn.poll(0.2):
            try:
                return conn.recv()
            except EOFError:
                break
        if not proc.is_alive():
            break
    if proc.is_alive():
        return f"rank {rank} did not load within {LOAD_TIMEOUT_S:.0f} s (TOKENFAB_TP_LOAD_TIMEOUT)"
    return (f"rank {rank} exited with code {proc.exitcode} while loading (a script that creates a tensor-"
            "parallel LLM must guard it with `if __name__ == \"__main__\":`, as multiprocessing's spawn needs)")

"""Tensor-parallel worker ranks as Ray actors: what a `serve --replicas` replica uses instead of
torch.multiprocessing (executor.choose_launcher).

Inside a Ray Serve replica the worker ranks are actors the replica creates, so Ray knows about them:
- **resources**: each rank declares what its replica was given (`num_cpus`, `memory`, one GPU on
  CUDA), so a replica of t ranks reserves t times its `ray_actor_options` and Ray never packs more
  ranks onto a node than it has room for;
- **placement**: every rank runs on its replica's node (node affinity, not soft): the group meets over
  gloo / NCCL on that node, at rank 0's TCPStore on 127.0.0.1 (or MASTER_ADDR);
- **lifetime**: the replica owns its actors, so Ray kills them when the replica dies, and a replica Ray
  restarts launches fresh ones.

Each step is an actor call (`execute`), submitted before rank 0 runs its own shard; the ranks then meet
in the all-reduces. A rank's calls run in order (one at a time), and rank 0 collects the previous
step's result before sending the next, so a worker error surfaces at once and nothing piles up.
"""
from __future__ import annotations

import logging

import torch

log = logging.getLogger("tokenfab.distributed")


class RankActor:
    """One worker rank (1 .. t-1) living in a Ray actor: its Worker (worker/worker.py) and its group."""

    def __init__(self, rank: int, config, kv, num_threads: int):
        self.args = (rank, config, kv)
        torch.set_num_threads(num_threads)
        self.worker = self.device = None

    def load(self) -> str:
        """"ok", or the error that stopped this rank loading (rank 0 raises it for the user)."""
        from tokenfab.distributed.worker import load_rank
        rank, config, kv = self.args
        # Ray sets CUDA_VISIBLE_DEVICES to this actor's GPU: it is cuda:0 here, whatever the rank
        device = "cuda:0" if torch.device(config.device).type == "cuda" else None
        try:
            self.worker, self.device = load_rank(rank, config, kv, device)
        except BaseException as e:      # noqa: BLE001
            return f"rank {rank} failed to load: {type(e).__name__}: {e}"
        return "ok"

    def join(self, addr: str, port: int) -> None:
        from tokenfab.distributed.group import join_store, make_group
        rank, config, _ = self.args
        size = config.tensor_parallel_size
        store = join_store(addr, port, size)
        self.store = store
        cuda = 0 if torch.device(config.device).type == "cuda" else None
        self.worker.model.tp_comm.group = make_group(store, config.device, rank, size, cuda_index=cuda)

    def execute(self, msg) -> None:
        from tokenfab.distributed.worker import decode_step
        self.worker.execute(decode_step(msg, self.device))


def rank_options(config) -> dict:
    """Ray options for each worker rank: the resources this replica was given, on this replica's node."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
    ctx = ray.get_runtime_context()
    got = ctx.get_assigned_resources() or {}
    opts = {"num_cpus": got.get("CPU", 1.0),
            "scheduling_strategy": NodeAffinitySchedulingStrategy(node_id=ctx.get_node_id(), soft=False)}
    if got.get("memory"):
        opts["memory"] = got["memory"]
    if torch.device(config.device).type == "cuda":
        opts["num_gpus"] = 1
    return opts


class RayWorkers:
    """Ranks 1..t-1 as Ray actors, with the same surface as executor._Workers."""

    def __init__(self):
        self.actors, self.pending, self.store = [], [], None
        self.procs = []           # what tests of the mp launcher read; Ray actors are not processes of ours

    def launch(self, config, kv, threads: int, shared=None) -> None:
        import ray
        assert shared is None, "Ray actor ranks use gloo (group.allreduce_backend)"
        from tokenfab.distributed.executor import LOAD_TIMEOUT_S
        if not ray.is_initialized():
            raise RuntimeError("distributed_executor_backend='ray' needs Ray started here (ray.init(), or "
                               "`tokenfab serve --replicas`); use 'mp' to launch the ranks as local processes")
        opts = rank_options(config)
        cls = ray.remote(RankActor)
        size = config.tensor_parallel_size
        self.actors = [cls.options(name=None, max_restarts=0, **opts).remote(
            rank, config, kv, threads) for rank in range(1, size)]
        refs = [a.load.remote() for a in self.actors]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=LOAD_TIMEOUT_S)
        if len(ready) < len(refs):
            raise RuntimeError(f"tensor parallelism: a worker rank did not load within {LOAD_TIMEOUT_S:.0f} s "
                               f"(TOKENFAB_TP_LOAD_TIMEOUT; Ray needs {opts['num_cpus']:g} free CPUs per rank "
                               "on this replica's node)")
        for rank, ref in enumerate(refs, start=1):
            try:
                status = ray.get(ref)
            except Exception as e:      # noqa: BLE001 - the actor died while loading
                status = f"rank {rank} died while loading: {type(e).__name__}: {e}"
            if status != "ok":
                raise RuntimeError(f"tensor parallelism: {status}")
        log.info("tensor parallelism: %d worker rank(s) as Ray actors, %s each", len(self.actors),
                 {k: v for k, v in opts.items() if k != "scheduling_strategy"})

    def join(self, addr: str, port: int) -> None:
        self.pending = [a.join.remote(addr, port) for a in self.actors]

    def joined(self) -> None:
        self._collect()

    def send(self, msg) -> None:
        self._collect()             # the previous step: done on every rank (rank 0 met them in its all-reduces)
        self.pending = [a.execute.remote(msg) for a in self.actors]

    def _collect(self) -> None:
        import ray
        refs, self.pending = self.pending, []
        if refs:
            ray.get(refs)           # raises the worker's error (RayActorError if it died)

    def dead(self) -> list[str]:
        import ray
        out = []
        for rank, a in enumerate(self.actors, start=1):
            try:
                ray.get(a.__ray_ready__.remote(), timeout=1)
            except Exception:       # noqa: BLE001 - dead or unreachable
                out.append(f"tokenfab-tp{rank} (Ray actor)")
        return out

    def stop(self, timeout: float = 10.0) -> None:
        try:
            import ray
            for a in self.actors:
                ray.kill(a, no_restart=True)
        except Exception as e:      # noqa: BLE001 - Ray already shut down: its actors went with it
            log.debug("stopping Ray worker ranks: %s", e)
        self.actors, self.pending, self.store = [], [], None

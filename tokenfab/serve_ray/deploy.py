"""Starting the replica pools on Ray Serve, from `tokenfab serve` flags or a Ray Serve config file.

    tokenfab serve --replicas 2 [--long-replicas 1 --long-prompt-threshold 1024] [--ray-address ADDR]
    tokenfab serve --config serve.yaml          # e.g. written by `tokenfab plan capacity --emit serve-config`

Each pool is one Ray Serve application holding one deployment of EngineReplica (replica.py) with its
resources declared (`ray_actor_options`: num_cpus, memory), tokenfab's RequestRouter (router.py), and
a health check that makes Ray replace a replica whose engine loop died. Ray Serve's own HTTP proxy is
off: the ingress is this process, running the server's FastAPI app on a ReplicaPoolEngine (pool.py).

The config file is Ray Serve's schema (validated with Ray's ServeDeploySchema): one application per
pool, `import_path: tokenfab.serve_ray.deploy:pool_app`, its `args` (pool, engine settings, the long
threshold) and its deployment's overrides (num_replicas or autoscaling_config, max_ongoing_requests,
ray_actor_options). tokenfab reads it and applies the same overrides.
"""
from __future__ import annotations

import dataclasses
import logging
import os

from tokenfab.serve_ray import routing
from tokenfab.serve_spec import DEPLOYMENT, PoolSpec, ServeSpec, spec_from_args, spec_from_config

log = logging.getLogger("tokenfab.serve_ray")

LOCAL_OBJECT_STORE = 256 << 20    # a local cluster's shared-memory store: only small request/output objects


def pool_app(args: dict):
    """The application builder named in the config's import_path (also usable by `serve deploy`)."""
    return _deployment(PoolSpec(args.get("pool", routing.SHORT_POOL), engine=dict(args.get("engine") or {})),
                       dict(args.get("engine") or {}), args.get("max_waiting_requests"))


def _deployment(pool: PoolSpec, engine: dict, max_waiting: int | None, block_size: int = 16):
    from ray import serve
    from ray.serve.config import RequestRouterConfig
    from tokenfab.serve_ray.replica import EngineReplica
    engine = {"num_threads": max(1, int(pool.num_cpus)), **engine, **pool.engine}
    router = RequestRouterConfig(request_router_class="tokenfab.serve_ray.router.TokenfabRouter", request_routing_stats_period_s=0.5,
                                 request_routing_stats_timeout_s=5.0,
                                 request_router_kwargs={"pool": pool.name, "prefix_affinity": pool.prefix_affinity,
                                                        "block_size": engine.get("block_size", block_size)})
    dep = serve.deployment(EngineReplica, name=DEPLOYMENT).options(
        request_router_config=router, health_check_period_s=2.0, health_check_timeout_s=30.0,
        graceful_shutdown_timeout_s=5.0, **pool.deployment_options())
    return dep.bind(engine, pool.name, max_waiting)


def start_pools(engine_config, spec: ServeSpec, max_waiting_requests: int | None = None):
    """Start (or join) Ray, run each pool's application, and return the ingress's ReplicaPoolEngine."""
    import ray
    from ray import serve
    from tokenfab.serve_ray.pool import ReplicaPoolEngine

    if not ray.is_initialized():
        if spec.ray_address:
            ray.init(address=spec.ray_address, include_dashboard=False, ignore_reinit_error=True)
        else:
            # a tensor-parallel replica's worker ranks are Ray actors declaring what the replica does
            tp = max(1, engine_config.tensor_parallel_size)
            need = sum(p.num_cpus * max(1, p.min_replicas()) * tp for p in spec.pools)
            cpus = max(os.cpu_count() or 1, int(need + 0.999))
            if need > (os.cpu_count() or 1):
                log.warning("the replicas declare %g CPUs but this machine has %d: they will share cores",
                            need, os.cpu_count())
            ray.init(num_cpus=cpus, include_dashboard=False, ignore_reinit_error=True,
                     object_store_memory=LOCAL_OBJECT_STORE)
    serve.start(proxy_location="Disabled")
    engine = {k: v for k, v in dataclasses.asdict(engine_config).items()}
    handles = {}
    for pool in spec.pools:
        log.info("starting pool %r: %s", pool.name, pool.deployment_options())
        handles[pool.name] = serve.run(_deployment(pool, engine, max_waiting_requests, engine_config.block_size),
                                       name=f"tokenfab-{pool.name}", route_prefix=None)
    desc = handles[routing.SHORT_POOL].describe.remote().result()
    for name, h in handles.items():                # every pool's router exists before /health asks
        if name != routing.SHORT_POOL:
            h.describe.remote().result()
    return ReplicaPoolEngine(handles, desc, spec.long_prompt_threshold)


def stop_pools(spec: ServeSpec) -> None:
    """Delete our applications; shut down the Ray we started (a joined cluster keeps running)."""
    import ray
    from ray import serve
    try:
        for p in spec.pools:
            serve.delete(f"tokenfab-{p.name}")
        if not spec.ray_address:
            serve.shutdown()
            ray.shutdown()
    except Exception as e:                   # shutting down: report, don't mask the real exit
        log.warning("stopping the replica pools: %s", e)


def start_from_args(args, engine_config, server_config):
    """`tokenfab serve --replicas/--config`: checks, then the pools. Returns (pool engine, spec)."""
    if getattr(args, "step_log", None) or server_config.slo_ttft_ms is not None \
            or server_config.slo_tpot_ms is not None:
        raise ValueError("--step-log and --slo-ttft-ms/--slo-tpot-ms work on one engine; they are not "
                         "available with --replicas or --config")
    try:
        import ray  # noqa: F401
        from ray import serve  # noqa: F401
    except ImportError:
        raise ValueError("--replicas and --config need Ray Serve: pip install 'tokenfab[ray]'") from None
    if args.config and (args.replicas is not None or args.long_replicas):
        raise ValueError("give either --config FILE or --replicas/--long-replicas, not both: the file says the pools")
    spec = spec_from_config(args.config, args.ray_address) if args.config else spec_from_args(args)
    if args.config:
        main = next(p for p in spec.pools if p.name == routing.SHORT_POOL)
        if main.engine:
            engine_config = dataclasses.replace(engine_config, **main.engine)
    return start_pools(engine_config, spec, server_config.max_waiting_requests), spec

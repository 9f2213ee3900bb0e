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
from dataclasses import dataclass, field

from tokenfab.serve_ray import routing

log = logging.getLogger("tokenfab.serve_ray")

IMPORT_PATH = "tokenfab.serve_ray.deploy:pool_app"
DEPLOYMENT = "EngineReplica"
DEFAULT_MEMORY = 2 << 30          # declared per replica: the bundled model and its KV pool fit with room
LOCAL_OBJECT_STORE = 256 << 20    # a local cluster's shared-memory store: only small request/output objects


@dataclass
class PoolSpec:
    name: str
    num_replicas: int | None = 1
    autoscaling_config: dict | None = None
    num_cpus: float = 1.0
    memory: int | None = DEFAULT_MEMORY
    max_ongoing_requests: int = 64
    engine: dict = field(default_factory=dict)      # EngineConfig overrides for this pool
    prefix_affinity: bool = True                    # False: least loaded only (--routing least-loaded)

    def deployment_options(self) -> dict:
        actor = {"num_cpus": self.num_cpus}
        if self.memory:
            actor["memory"] = self.memory
        opts = {"ray_actor_options": actor, "max_ongoing_requests": self.max_ongoing_requests}
        if self.autoscaling_config:
            opts["autoscaling_config"] = dict(self.autoscaling_config)
            opts["num_replicas"] = "auto"
        else:
            opts["num_replicas"] = self.num_replicas
        return opts

    def min_replicas(self) -> int:
        if self.autoscaling_config:
            return int(self.autoscaling_config.get("min_replicas", 1))
        return int(self.num_replicas or 0)


@dataclass
class ServeSpec:
    pools: list[PoolSpec]
    long_prompt_threshold: int | None = None
    ray_address: str | None = None

    def validate(self) -> None:
        names = [p.name for p in self.pools]
        if routing.SHORT_POOL not in names:
            raise ValueError(f"the replicas need a {routing.SHORT_POOL!r} pool (give --replicas N, N >= 1)")
        if routing.LONG_POOL in names and self.long_prompt_threshold is None:
            raise ValueError("--long-replicas needs --long-prompt-threshold TOKENS: prompts of at least that many "
                             "tokens go to the long pool")
        for p in self.pools:
            if p.min_replicas() < 1 and not p.autoscaling_config:
                raise ValueError(f"pool {p.name!r} needs at least one replica")
            if p.num_cpus <= 0:
                raise ValueError(f"pool {p.name!r}: num_cpus must be positive, got {p.num_cpus}")


def spec_from_args(args) -> ServeSpec:
    cpus = getattr(args, "replica_cpus", None) or 1.0
    memory = getattr(args, "replica_memory", None) or DEFAULT_MEMORY
    if args.replicas is None or args.replicas < 1:
        raise ValueError(f"--replicas must be at least 1, got {args.replicas}")
    affinity = getattr(args, "routing", "prefix-affinity") != "least-loaded"
    pools = [PoolSpec(routing.SHORT_POOL, args.replicas, num_cpus=cpus, memory=memory, prefix_affinity=affinity)]
    long_replicas = getattr(args, "long_replicas", None) or 0
    if long_replicas < 0:
        raise ValueError(f"--long-replicas must be 0 or more, got {long_replicas}")
    if long_replicas:
        pools.append(PoolSpec(routing.LONG_POOL, long_replicas, num_cpus=cpus, memory=memory,
                              prefix_affinity=affinity))
    spec = ServeSpec(pools, getattr(args, "long_prompt_threshold", None), getattr(args, "ray_address", None))
    spec.validate()
    return spec


def read_serve_config(path: str) -> dict:
    import yaml
    try:
        with open(path) as f:
            doc = yaml.safe_load(f)
    except OSError as e:
        raise ValueError(f"--config {path}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise ValueError(f"--config {path}: not valid YAML ({e})") from None
    if not isinstance(doc, dict):
        raise ValueError(f"--config {path}: expected a Ray Serve config (a mapping with `applications`)")
    from ray.serve.schema import ServeDeploySchema
    try:
        ServeDeploySchema.model_validate(doc) if hasattr(ServeDeploySchema, "model_validate") \
            else ServeDeploySchema.parse_obj(doc)
    except Exception as e:
        raise ValueError(f"--config {path}: not a valid Ray Serve config: {e}") from None
    return doc


def spec_from_config(path: str, ray_address: str | None = None) -> ServeSpec:
    doc = read_serve_config(path)
    pools, threshold = [], None
    for app in doc.get("applications") or []:
        if app.get("import_path") != IMPORT_PATH:
            raise ValueError(f"--config {path}: application {app.get('name')!r} imports "
                             f"{app.get('import_path')!r}; tokenfab runs only {IMPORT_PATH}")
        args = app.get("args") or {}
        dep = next((d for d in app.get("deployments") or [] if d.get("name") == DEPLOYMENT), {})
        actor = dep.get("ray_actor_options") or {}
        pool = PoolSpec(args.get("pool", routing.SHORT_POOL), dep.get("num_replicas", 1),
                        dep.get("autoscaling_config"), float(actor.get("num_cpus", 1.0)),
                        actor.get("memory", DEFAULT_MEMORY), int(dep.get("max_ongoing_requests", 64)),
                        dict(args.get("engine") or {}))
        if pool.num_replicas == "auto":
            pool.num_replicas = None
        pools.append(pool)
        threshold = args.get("long_prompt_threshold", threshold)
    spec = ServeSpec(pools, threshold, ray_address)
    spec.validate()
    return spec


def serve_config(spec: ServeSpec, engine: dict | None = None, comment: str = "") -> dict:
    """The Ray Serve config document for `spec` (what `plan capacity --emit serve-config` writes)."""
    apps = []
    for p in spec.pools:
        dep = {"name": DEPLOYMENT, **p.deployment_options()}
        if p.autoscaling_config:
            dep.pop("num_replicas")
        args = {"pool": p.name, "engine": {**(engine or {}), **p.engine}}
        if spec.long_prompt_threshold is not None:
            args["long_prompt_threshold"] = spec.long_prompt_threshold
        apps.append({"name": f"tokenfab-{p.name}", "route_prefix": None, "import_path": IMPORT_PATH,
                     "args": args, "deployments": [dep]})
    return {"proxy_location": "Disabled", "applications": apps}


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

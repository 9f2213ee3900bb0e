"""The replica pools' spec and its Ray Serve config document, without Ray.

`tokenfab plan capacity --emit serve-config` writes the document (`serve_config`), `tokenfab serve
--config FILE` reads it back (`spec_from_config`), and `serve --replicas N` builds the same spec from
flags (`spec_from_args`); serve_ray/deploy.py starts the pools it describes. A leaf, so the planner
writes the config without importing the serving code.
"""
from __future__ import annotations

from dataclasses import dataclass, field

SHORT_POOL, LONG_POOL = "main", "long"     # the pools: every prompt, and (with --long-replicas) long ones
IMPORT_PATH = "tokenfab.serve_ray.deploy:pool_app"
DEPLOYMENT = "EngineReplica"
DEFAULT_MEMORY = 2 << 30          # declared per replica: the bundled model and its KV pool fit with room


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
        if SHORT_POOL not in names:
            raise ValueError(f"the replicas need a {SHORT_POOL!r} pool (give --replicas N, N >= 1)")
        if LONG_POOL in names and self.long_prompt_threshold is None:
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
    pools = [PoolSpec(SHORT_POOL, args.replicas, num_cpus=cpus, memory=memory, prefix_affinity=affinity)]
    long_replicas = getattr(args, "long_replicas", None) or 0
    if long_replicas < 0:
        raise ValueError(f"--long-replicas must be 0 or more, got {long_replicas}")
    if long_replicas:
        pools.append(PoolSpec(LONG_POOL, long_replicas, num_cpus=cpus, memory=memory,
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
        pool = PoolSpec(args.get("pool", SHORT_POOL), dep.get("num_replicas", 1),
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

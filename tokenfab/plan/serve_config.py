"""`tokenfab plan capacity ... --emit serve-config FILE`: the capacity answer as a Ray Serve config that
`tokenfab serve --config FILE` runs (docs/scale_out.md).

From the plan (the SLO, the traffic, the step costs: roofline or a measured --step-table):
- max_replicas: the replicas the plan needs at the stated rate (the peak: the SLO holds there);
- target_ongoing_requests: the requests one replica holds at that point, by Little's law
  (its arrival rate x the simulated mean end-to-end latency), so Ray's autoscaler reaches max_replicas
  exactly when the traffic reaches the planned rate, and scales down below it;
- min_replicas 1, initial_replicas max_replicas (start ready for the peak);
- max_ongoing_requests: the planned max_num_seqs, or twice the target if more (beyond it a replica
  refuses, and the request waits in the handle for room);
- the engine's scheduler settings as planned (max_num_seqs, max_num_batched_tokens, block_size).
Writing the file imports no Ray: the document is built here and validated by `serve --config`.
"""
from __future__ import annotations

import math

import yaml

from tokenfab.serve_spec import DEFAULT_MEMORY, PoolSpec, ServeSpec, serve_config

KINDS = ("serve-config",)


def capacity_serve_config(result: dict, num_cpus: float = 1.0, memory: int | None = None) -> dict:
    """The Ray Serve config for a `run_capacity` result (raises ValueError when the plan found no answer)."""
    replicas = result.get("replicas")
    online = result.get("online") or {}
    if not replicas:
        raise ValueError("the plan found no replica count that meets the SLO, so there is no serve config to "
                         "write; relax --slo or raise --max-replicas")
    per_replica_rate = result["traffic"]["rate"] / replicas
    e2e = (online.get("e2e") or {}).get("mean")
    if e2e is None or not math.isfinite(e2e):
        raise ValueError("the plan's simulation has no end-to-end latency to size target_ongoing_requests from")
    target = max(1.0, round(per_replica_rate * e2e, 1))
    autoscaling = {"min_replicas": 1, "initial_replicas": replicas, "max_replicas": replicas,
                   "target_ongoing_requests": target}
    sched = result.get("scheduler") or {}
    engine = {k: sched[k] for k in ("max_num_seqs", "max_num_batched_tokens", "block_size") if k in sched}
    pool = PoolSpec("main", None, autoscaling, num_cpus, memory or DEFAULT_MEMORY,
                    max(int(sched.get("max_num_seqs", 2)), int(math.ceil(2 * target))), engine)
    doc = serve_config(ServeSpec([pool]))
    return doc


def write(kind: str, path: str, result: dict) -> str:
    if kind not in KINDS:
        raise ValueError(f"--emit {kind}: unknown kind; choose one of {', '.join(KINDS)}")
    doc = capacity_serve_config(result)
    header = (f"# Ray Serve config written by `tokenfab plan capacity` for {result['model']['name']} on "
              f"{result['hardware']}: {result['traffic']['rate']:g} req/s, SLO {result['slo']}.\n"
              f"# Run it with: tokenfab serve --config {path}\n")
    try:
        with open(path, "w") as f:
            f.write(header + yaml.safe_dump(doc, sort_keys=False))
    except OSError as e:
        raise ValueError(f"--emit {kind} {path}: {e.strerror}") from None
    return path

"""The server's app as the ingress of the Ray Serve replica pools (--replicas): `ingress_app`, and its
/metrics additions: each replica's engine stats with `pool` and `replica` labels, the pools' sizes, and
every routing decision.

The server's own families (tokenfab:num_requests_running, tokenfab:prefix_cache_hits, ...) stay as they
are and show the sum over the replicas (server/metrics.py reads the pool engine's summed stats); the
per-replica series are `tokenfab:replica_<same name>`, since one family cannot carry two label sets.
A restarted replica starts its counters from zero (Prometheus' rate() treats that as a reset).
"""
from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from tokenfab.serve_ray import routing
from tokenfab.server.app import build_app
from tokenfab.server.metrics import PREFIX

_GAUGES = [("num_requests_running", "num_running"), ("num_requests_waiting", "num_waiting"),
           ("kv_cache_usage_perc", "kv_cache_usage")]
_COUNTERS = [("prefix_cache_queries", "prefix_cache_queries"), ("prefix_cache_hits", "prefix_cache_hits"),
             ("num_preemptions", "num_preemptions"), ("prompt_tokens", "prompt_tokens"),
             ("generation_tokens", "generation_tokens")]


class ReplicaCollector:
    def __init__(self, pool_engine, model_name: str) -> None:
        self.pool_engine = pool_engine
        self.model_name = model_name

    def collect(self):
        stats = self.pool_engine.replica_stats()
        labels = ["model_name", "pool", "replica"]
        for family, names in ((GaugeMetricFamily, _GAUGES), (CounterMetricFamily, _COUNTERS)):
            for name, attr in names:
                f = family(PREFIX + "replica_" + name, f"{name}, per replica.", labels=labels)
                for pool, reps in stats.items():
                    for rid, s in reps.items():
                        if attr in s:
                            f.add_metric([self.model_name, pool, rid], float(s[attr]))
                yield f
        g = GaugeMetricFamily(PREFIX + "pool_replicas", "Running replicas per pool (0: /health says degraded).",
                              labels=["model_name", "pool"])
        for pool, reps in stats.items():
            g.add_metric([self.model_name, pool], float(len(reps)))
        yield g
        c = CounterMetricFamily(PREFIX + "router_decisions", "Requests routed, by pool, reason "
                                "(prefix_affinity, prefix_overflow, least_loaded) and replica.",
                                labels=["model_name", "pool", "reason", "replica"])
        for (pool, reason, rid), n in sorted(routing.DECISIONS.snapshot().items()):
            c.add_metric([self.model_name, pool, reason, rid], float(n))
        yield c
        c = CounterMetricFamily(PREFIX + "router_retries", "Requests re-sent to another replica because theirs "
                                "failed before their first output.", labels=["model_name"])
        c.add_metric([self.model_name], float(self.pool_engine.retries))
        yield c


def ingress_app(pool_engine, server_config):
    """The server's FastAPI app (the same routes) on the pools (serve_ray/pool.py's ReplicaPoolEngine),
    with the per-replica series and routing decisions added to its /metrics."""
    app = build_app(pool_engine, server_config)
    state = app.state.tokenfab
    state.metrics.registry.register(ReplicaCollector(pool_engine, state.model_name))
    return app

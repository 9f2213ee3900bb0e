"""tokenfab's routing policy (routing.py) as a Ray Serve RequestRouter: Ray's extension point for
choosing a replica, which runs inside the ingress's DeploymentHandles.

Ray calls `choose_replicas` with the running replicas and the pending request (its kwargs carry the
prompt's token ids). We answer ranks: the policy's first choice alone, then the rest by load. Ray
sends to the first rank that has room (`max_ongoing_requests`), so a full replica is skipped without
us knowing. Loads combine what this router routed and has not seen finish (exact, instant) with each
replica's engine stats (waiting sequences, KV usage), which Ray polls from the replicas'
`record_routing_stats` every `request_routing_stats_period_s` and hands to the router.

The routers register themselves per pool, so the ingress reads the replicas' stats (/metrics, /health)
from the same place routing does.
"""
from __future__ import annotations

from collections import Counter

from ray.serve.request_router import PendingRequest, ReplicaID, ReplicaResult, RequestRouter, RunningReplica

from tokenfab.serve_ray import routing

# Ray pickles this module *by value* to ship the class (RequestRouterConfig), so shared state (the
# router registry, the decision counters) lives in routing.py, which is imported by reference.


class TokenfabRouter(RequestRouter):
    def initialize_state(self, pool: str = routing.SHORT_POOL, block_size: int = 16, load_slack: float = 0.25,
                         prefix_blocks: int = 4, prefix_affinity: bool = True, **_) -> None:
        self.pool = pool
        self.block_size = block_size
        self.load_slack = load_slack
        self.prefix_blocks = prefix_blocks
        self.prefix_affinity = prefix_affinity       # off: every request least loaded (benchmarks compare)
        self.in_flight: Counter[ReplicaID] = Counter()
        self._routed_to: dict[str, ReplicaID] = {}
        self._reasons: dict[str, str] = {}
        routing.register_router(pool, self)

    def loads(self, replicas: list[RunningReplica]) -> list[routing.ReplicaLoad]:
        out = []
        for r in replicas:
            stats = r.routing_stats or {}
            out.append(routing.ReplicaLoad(r.replica_id.unique_id, self.in_flight[r.replica_id],
                                           int(stats.get("num_waiting", 0)), float(stats.get("kv_cache_usage", 0.0))))
        return out

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        ids = (pending_request.kwargs.get("prompt_ids") if pending_request is not None else None) or []
        key = routing.prefix_key(ids, self.block_size, self.prefix_blocks) if self.prefix_affinity else None
        order, reason = routing.rank(self.loads(candidate_replicas), key, self.load_slack)
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        if pending_request is not None and pending_request.metadata.call_method == "generate":
            self._reasons[pending_request.metadata.internal_request_id] = reason
        ranked = [by_id[order[0]]]
        return [ranked, [by_id[i] for i in order[1:]]] if len(order) > 1 else [ranked]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result: ReplicaResult) -> None:
        rid = pending_request.metadata.internal_request_id
        reason = self._reasons.pop(rid, None)
        if reason is None:                    # describe(): not a request to count
            return
        self.in_flight[replica_id] += 1
        self._routed_to[rid] = replica_id
        routing.DECISIONS.add(self.pool, reason, replica_id.unique_id)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        if self._routed_to.pop(internal_request_id, None) is not None and self.in_flight[replica_id] > 0:
            self.in_flight[replica_id] -= 1

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.in_flight.pop(replica_id, None)

    def replica_stats(self) -> dict[str, dict]:
        """The pool's running replicas and the stats each last reported."""
        return {rid.unique_id: dict(r.routing_stats or {}) for rid, r in self.curr_replicas.items()}

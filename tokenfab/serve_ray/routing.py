"""The routing policy, as pure functions of the replicas' loads (no Ray here; router.py applies it).

A request goes to the pool its prompt length picks (the long pool for prompts of at least the long
threshold, when there is one), then to a replica of that pool:
- **prefix affinity**: the hash of the prompt's first KV blocks ranks the replicas by rendezvous
  (highest-random-weight) hashing, so the same prefix prefers the same replica and a replica that comes
  or goes moves only its own share of prefixes. The preferred replica is taken unless its load is over
  the bound `(1 + load_slack) * mean load + 1`: a hot prefix then spills to the next replica in its
  ranking ("consistent hashing with bounded loads"), so one prefix cannot overload one replica.
- **least loaded** otherwise (prompts shorter than one block), by queue (requests routed and not
  finished, plus the engine's waiting sequences) and KV usage.

Every decision is counted by (pool, reason, replica): `tokenfab:router_decisions_total` in /metrics.
"""
from __future__ import annotations

import hashlib
import threading
from collections import Counter
from dataclasses import dataclass

from tokenfab.serve_spec import LONG_POOL, SHORT_POOL  # noqa: F401  (the pools' names)
from tokenfab.engine.lanes import is_long_prompt

# Reasons, as they appear in the metric's `reason` label.
AFFINITY = "prefix_affinity"          # the prefix's preferred replica
SPILL = "prefix_overflow"             # the preferred replica was over the load bound: next in the ranking
LEAST_LOADED = "least_loaded"         # no prefix key (prompt shorter than a block)



@dataclass(frozen=True)
class ReplicaLoad:
    replica: str
    in_flight: int = 0          # requests this ingress routed there and not yet finished
    waiting: int = 0            # the engine's waiting sequences (from its last reported stats)
    kv_usage: float = 0.0       # 0..1

    @property
    def load(self) -> float:
        # A full KV pool counts like a few queued requests: new work there would preempt or wait.
        return self.in_flight + self.waiting + 4.0 * self.kv_usage


def prefix_key(token_ids, block_size: int, max_blocks: int = 4) -> str | None:
    """A hash of the prompt's first full KV blocks (at most `max_blocks`), or None when it has no full block.

    Only the first blocks: two prompts sharing a long system prompt hash alike whatever follows."""
    n = min(len(token_ids) // block_size, max_blocks) * block_size
    if n == 0:
        return None
    data = ",".join(map(str, token_ids[:n])).encode()
    return hashlib.blake2b(data, digest_size=8).hexdigest()


def rendezvous_order(key: str, replicas: list[str]) -> list[str]:
    """Replicas ranked for `key`, highest weight first (stable when others join or leave)."""
    def weight(r: str) -> bytes:
        return hashlib.blake2b(f"{key}|{r}".encode(), digest_size=8).digest()
    return sorted(replicas, key=weight, reverse=True)


def rank(loads: list[ReplicaLoad], key: str | None, load_slack: float = 0.25) -> tuple[list[str], str]:
    """Replica ids in order of preference, and the reason for the first choice."""
    if not loads:
        return [], LEAST_LOADED
    by_load = sorted(loads, key=lambda r: (r.load, r.replica))
    if key is None or len(loads) == 1:
        return [r.replica for r in by_load], (AFFINITY if key is not None else LEAST_LOADED)
    load_of = {r.replica: r.load for r in loads}
    bound = (1.0 + load_slack) * (sum(load_of.values()) / len(loads)) + 1.0
    order = rendezvous_order(key, list(load_of))
    for i, rid in enumerate(order):
        if load_of[rid] <= bound:
            first = rid
            reason = AFFINITY if i == 0 else SPILL
            break
    else:                                     # everyone is over the bound: plain least loaded
        return [r.replica for r in by_load], SPILL
    return [first] + [r.replica for r in by_load if r.replica != first], reason


def choose_pool(num_prompt_tokens: int, long_threshold: int | None, pools: set[str]) -> str:
    if LONG_POOL in pools and is_long_prompt(num_prompt_tokens, long_threshold):
        return LONG_POOL
    return SHORT_POOL


class DecisionCounter:
    """Routing decisions by (pool, reason, replica); written by the routers, read by /metrics."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[tuple[str, str, str]] = Counter()

    def add(self, pool: str, reason: str, replica: str) -> None:
        with self._lock:
            self._counts[(pool, reason, replica)] += 1

    def snapshot(self) -> dict[tuple[str, str, str], int]:
        with self._lock:
            return dict(self._counts)


# One per process: the routers live inside Ray's handles, in the ingress process.
DECISIONS = DecisionCounter()


_routers_lock = threading.Lock()
_ROUTERS: dict[str, list] = {}      # pool -> the RequestRouters of its handles in this process (router.py)


def register_router(pool: str, router) -> None:
    with _routers_lock:
        _ROUTERS.setdefault(pool, []).append(router)


def unregister_router(pool: str, router) -> None:
    """Forget a router whose application was deleted (its replicas' stats would otherwise linger)."""
    with _routers_lock:
        if router in _ROUTERS.get(pool, ()):
            _ROUTERS[pool].remove(router)


def routers(pool: str) -> list:
    with _routers_lock:
        return list(_ROUTERS.get(pool, ()))

"""One replica: a Ray Serve deployment replica that owns one AsyncEngine.

The ingress calls `generate` through a streaming DeploymentHandle. The stream's first item is
`("accepted", prompt_ids)` once the engine has queued the request (bad input raises before that, so
the ingress answers 400 and never retries it); then cumulative RequestOutputs follow, as from a
local AsyncEngine. Cancelling the call (the client left) aborts the engine request: Serve cancels the
generator and its `finally` frees the KV blocks.

`record_routing_stats` is what Ray polls for the router (router.py): the engine's stats snapshot,
which also feeds the ingress's /metrics and /health.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import os

from tokenfab.config import EngineConfig
from tokenfab.engine.async_engine import AsyncEngine
from tokenfab.sampling import SamplingParams

log = logging.getLogger("tokenfab.serve_ray")

ACCEPTED = "accepted"


class EngineReplica:
    def __init__(self, engine_config: dict, pool: str, max_waiting_requests: int | None = None) -> None:
        from tokenfab.engine.engine import LLMEngine
        self.pool = pool
        self.engine = LLMEngine(EngineConfig(**engine_config))
        self.async_engine = AsyncEngine(self.engine, max_waiting_requests=max_waiting_requests)
        try:
            from ray import serve
            self.replica_id = serve.get_replica_context().replica_id.unique_id
        except Exception:                     # constructed outside Serve (unit use)
            self.replica_id = f"local-{os.getpid()}"

    def _ensure_started(self) -> None:
        if not self.async_engine.started:         # the worker must post to the loop that reads the streams
            self.async_engine.start()

    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams, priority: int = 0,
                       arrival_time: float | None = None, service_class: str = "interactive"):
        self._ensure_started()
        stream = await self.async_engine.add_request(request_id, prompt_ids, params, priority, arrival_time,
                                                     service_class)
        try:
            yield (ACCEPTED, stream.prompt_token_ids, self.replica_id)
            async for out in stream:
                yield out
        finally:
            stream.abort()                    # no-op once finished; frees the blocks when cancelled

    async def describe(self) -> dict:
        """What the ingress needs to tokenize and check requests without loading the weights."""
        return {"info": self.async_engine.info, "tokenizer": self.async_engine.tokenizer}

    def record_routing_stats(self) -> dict:
        stats = dataclasses.asdict(self.async_engine.stats())
        stats["pool"] = self.pool
        stats["replica"] = self.replica_id
        stats["dead_reason"] = self.async_engine.dead_reason
        return stats

    async def check_health(self) -> None:
        """Serve's health check: a dead engine loop makes Ray replace this replica."""
        if self.async_engine.dead_reason is not None:
            raise RuntimeError(f"engine dead: {self.async_engine.dead_reason}")

    def __del__(self) -> None:
        try:
            if self.async_engine.started:
                asyncio.run_coroutine_threadsafe(self.async_engine.stop(), self.async_engine._loop)
        except Exception:
            pass

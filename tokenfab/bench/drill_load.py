"""The background load of a fault drill and the ledger every request of a drill ends up in.

The load is the soak's mixed workload (soak_mix.py, dispatched by soak.py's `dispatch`), closed-loop at
a fixed concurrency, run until the drill stops it. Every request, the load's and the drill's own probes,
gets exactly one outcome:

- `refused`: never accepted; the connection was refused (the server was down or had stopped listening);
- `completed`: answered with a finish reason (a stream that ends without one is not complete);
- `aborted`: the client hung up on purpose (the mix's aborts, the drills' disconnects);
- `failed`: a clear error: a 4xx, a 503 (draining, engine down) or a 507 (disk full) with an OpenAI
  error body, or an error event inside a 200 stream;
- `cut`: accepted, then its connection died with a server the drill killed (SIGKILL) while it ran;
- `lost`: anything else: a 500, a timeout, a connection dropped without a kill, a stream that stopped
  without a finish reason, a structured answer that breaks its schema. A drill passes only with none.
"""
from __future__ import annotations

import asyncio
import math
import time
from collections import Counter
from dataclasses import dataclass, field

from tokenfab.bench.client import RawResult
from tokenfab.bench.soak import SoakConfig, dispatch
from tokenfab.bench.soak_mix import SoakWorkload

CLEAR_STATUSES = {503, 507}             # server-side refusals with a body that says why and when to retry
OUTCOMES = ("refused", "completed", "aborted", "failed", "cut", "lost")


def outcome(raw: RawResult, killed: list[float] = ()) -> str:
    """One of OUTCOMES for a finished request; `killed`: perf_counter times the drill killed the server."""
    err = raw.error or ""
    if raw.status is None and err.startswith("ConnectError"):
        return "refused"
    if err == "":
        if raw.hung_up:
            return "aborted"
        return "completed" if raw.finish_reason is not None else "lost"
    if raw.status is not None and raw.status != 200:
        return "failed" if 400 <= raw.status < 500 or raw.status in CLEAR_STATUSES else "lost"
    if err.startswith("error in stream"):
        return "failed"
    if err.startswith("structured output"):
        return "lost"
    if any(raw.sent <= t <= raw.end for t in killed):
        return "cut"
    return "lost"


@dataclass(slots=True)
class Tally:
    """Outcome counts over a drill's requests, with a few messages of what went wrong."""
    counts: Counter = field(default_factory=Counter)
    duplicated: int = 0                 # results beyond one per request (batch lines)
    messages: Counter = field(default_factory=Counter)

    def add(self, raw: RawResult, killed: list[float] = ()) -> str:
        kind = outcome(raw, killed)
        self.counts[kind] += 1
        if kind in ("failed", "lost", "cut"):
            self.messages[f"{kind}: {(raw.error or 'no finish reason')[:120]}"] += 1
        return kind

    def __getitem__(self, kind: str) -> int:
        return self.counts[kind]

    @property
    def sent(self) -> int:
        return sum(self.counts.values())

    @property
    def accepted(self) -> int:
        return self.sent - self.counts["refused"]

    def as_dict(self) -> dict:
        return {"sent": self.sent, "accepted": self.accepted, **{k: self.counts[k] for k in OUTCOMES},
                "duplicated": self.duplicated, "messages": dict(self.messages.most_common(8))}


class BackgroundLoad:
    """The soak mix against `cfg.base_url` until the block exits; `results` then holds every request's
    (SoakRequest, RawResult), and `completed_streams()` those to time TPOT with.

        async with BackgroundLoad(client, cfg, workload) as load:
            ...                                  # the fault
        tally = load.tally(killed=[t_kill])
    """

    def __init__(self, client, cfg: SoakConfig, workload: SoakWorkload, seed: int = 0) -> None:
        self.client, self.cfg, self.workload, self.seed = client, cfg, workload, seed
        self.results: list[tuple] = []
        self.finished: list[RawResult] = []     # as they finish, for drills that look before the end
        self._stop = asyncio.Event()
        self._task: asyncio.Task | None = None

    async def __aenter__(self) -> "BackgroundLoad":
        self._task = asyncio.create_task(dispatch(self.client, self.cfg, self.workload, math.inf, self.seed,
                                                  time.perf_counter, self.finished.append, self._stop))
        return self

    async def __aexit__(self, *exc) -> None:
        self._stop.set()
        assert self._task is not None
        done = await self._task
        self.results = [(sr, raw) for sr, raw, _, _ in done]

    def tally(self, killed: list[float] = (), into: Tally | None = None) -> Tally:
        t = into or Tally()
        for _, raw in self.results:
            t.add(raw, killed)
        return t

"""`tokenfab bench drills`: faults injected into a real `tokenfab serve` while the soak's mixed workload
runs against it, each judged on what happened to every request (drill_load.py's ledger), on the KV
blocks left held once idle, and on how long the server took to recover by itself.

The drills themselves, their registry and the runner are in drill_cases.py (with drill_data.py for the
data dir's drills and drill_ray.py for Ray Serve's); this module holds what they share: the settings, the
context (the shared server, a client, the workload), the result row, the tables.

A drill passes when every check it makes holds, no request is lost or answered twice, and no KV block
is held once the server is idle (docs/bench.md, "bench drills").
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from tokenfab.bench import probe
from tokenfab.bench.client import Endpoint
from tokenfab.bench.drill_load import BackgroundLoad, Tally
from tokenfab.bench.local_server import ServeProcess
from tokenfab.bench.probe import ServerSample
from tokenfab.bench.soak import SoakConfig
from tokenfab.bench.soak_mix import SoakMix, SoakWorkload, make_endpoints
from tokenfab.bench.tokens import TokenCounter

# Short prompts and answers: a drill is about what the faults do to requests, not about speed, and a
# 2-core machine must run the whole set in minutes. The mix keeps its hang-ups and structured requests.
DRILL_MIX = SoakMix(input_len="16", long_input_len="96", output_len="16", long_fraction=0.1,
                    abort_fraction=0.2, structured_fraction=0.1)


@dataclass(slots=True)
class DrillConfig:
    workdir: Path                             # logs, data dirs, mount points
    concurrency: int = 2                      # background requests in flight
    mix: SoakMix = field(default_factory=lambda: DRILL_MIX)
    load_s: float = 4.0                       # seconds of load per drill phase
    # Small prefill chunks, so a long prompt stays in prefill for several engine steps: a hang-up can
    # land mid-prefill, and other streams keep decoding meanwhile.
    max_num_batched_tokens: int = 256
    max_model_len: int = 2048
    probe_tokens: int = 1800                  # the disconnect drill's long prompt
    slow_readers: int = 4
    slow_read_bytes_per_s: int = 256
    max_tpot_ratio: float = 1.5               # the load's P50 TPOT beside slow readers, over beside fast ones
    max_rss_growth_mib: float = 16.0          # RSS less KV pages: slow readers over fast ones (4 answers: 1.2 MiB)
    idle_connections: int = 1000
    batch_lines: int = 8
    tmpfs_bytes: int = 4 << 20                # the ENOSPC drill's data dir
    shutdown_timeout_s: float = 30.0
    timeout_s: float = 120.0                  # per request
    seed: int = 0
    extra_serve_flags: list[str] = field(default_factory=list)

    def serve_flags(self, *more: str) -> list[str]:
        return ["--no-ui", "--max-num-seqs", "8", "--max-model-len", str(self.max_model_len),
                "--max-num-batched-tokens", str(self.max_num_batched_tokens),
                "--shutdown-timeout", f"{self.shutdown_timeout_s:g}", *self.extra_serve_flags, *more]

    def validate(self) -> None:
        if self.concurrency < 1:
            raise ValueError(f"--concurrency {self.concurrency}: need at least 1")
        if not self.load_s > 0:
            raise ValueError(f"--load-seconds {self.load_s:g}: must be positive")
        if self.idle_connections < 1:
            raise ValueError(f"--idle-connections {self.idle_connections}: need at least 1")
        if not 0 < self.probe_tokens < self.max_model_len - 64:
            raise ValueError(f"the probe prompt ({self.probe_tokens} tokens) must leave room for an answer "
                             f"under --max-model-len {self.max_model_len}")
        self.mix.validate()


@dataclass(slots=True)
class Check:
    what: str
    held: bool
    detail: str = ""


@dataclass(slots=True)
class DrillResult:
    name: str
    fault: str
    tally: Tally = field(default_factory=Tally)
    recovery_s: float | None = None           # fault over → server back to normal (what "normal" is: per drill)
    kv_idle_blocks: int | None = None         # KV blocks held once idle after the drill (None: not measurable)
    checks: list[Check] = field(default_factory=list)
    skipped: str | None = None                # why the drill could not run here
    seconds: float = 0.0                      # wall time of the drill

    def check(self, what: str, held: bool, detail: str = "") -> bool:
        self.checks.append(Check(what, bool(held), detail))
        return bool(held)

    @property
    def passed(self) -> bool:
        return (self.skipped is None and all(c.held for c in self.checks) and self.tally["lost"] == 0
                and self.tally.duplicated == 0 and self.kv_idle_blocks in (None, 0))

    @property
    def verdict(self) -> str:
        return "skipped" if self.skipped else "pass" if self.passed else "FAIL"

    def as_dict(self) -> dict:
        return {"name": self.name, "fault": self.fault, "verdict": self.verdict, **self.tally.as_dict(),
                "recovery_s": self.recovery_s, "kv_idle_blocks": self.kv_idle_blocks, "seconds": self.seconds,
                "skipped": self.skipped, "checks": [{"what": c.what, "held": c.held, "detail": c.detail}
                                                     for c in self.checks]}


class BackoffTransport(httpx.AsyncHTTPTransport):
    """A refused connection is reported after a short pause, as a client that retries would wait: the
    closed-loop load must not spin on a server that is down (a restart would compete with it)."""
    pause_s = 0.25

    async def handle_async_request(self, request):
        try:
            return await super().handle_async_request(request)
        except httpx.ConnectError:
            await asyncio.sleep(self.pause_s)
            raise


class DrillContext:
    """What a drill works with. The shared server is started on first use and again whenever a drill
    left it stopped (SIGTERM); drills that need their own data dir start their own with `new_server`."""

    def __init__(self, cfg: DrillConfig, counter: TokenCounter) -> None:
        self.cfg, self.counter = cfg, counter
        self.cfg.workdir.mkdir(parents=True, exist_ok=True)
        self._shared: ServeProcess | None = None
        self.server: ServeProcess | None = None   # the server the current drill's helpers talk to
        self.client: httpx.AsyncClient | None = None
        self.model = "default"

    def new_server(self, name: str, *flags: str) -> ServeProcess:
        return ServeProcess(self.cfg.serve_flags(*flags), self.cfg.workdir / f"{name}.log")

    async def shared(self) -> ServeProcess:
        if self._shared is None:
            self._shared = self.new_server("shared")
        if not self._shared.alive:
            await self._shared.start()
        await self.use(self._shared)
        return self._shared

    async def use(self, server: ServeProcess) -> None:
        self.server = server
        r = await self.client.get(f"{server.url}/v1/models")
        self.model = r.json()["data"][0]["id"]

    def close(self) -> None:
        if self._shared is not None:
            self._shared.stop()

    # -- helpers the drills share ------------------------------------------------------------------
    def endpoint(self) -> Endpoint:
        return Endpoint(base_url=self.server.url, model=self.model, stream_usage="continuous",
                        timeout_s=self.cfg.timeout_s)

    def load(self, seed: int = 0) -> BackgroundLoad:
        cfg = self.cfg
        soak = SoakConfig(base_url=self.server.url, model=self.model, max_concurrency=cfg.concurrency,
                          mix=cfg.mix, timeout_s=cfg.timeout_s)
        workload = SoakWorkload(cfg.mix, self.counter, make_endpoints(self.endpoint()), seed=cfg.seed + seed)
        return BackgroundLoad(self.client, soak, workload, cfg.seed + seed)

    async def sample(self) -> ServerSample:
        return await probe.sample(self.client, self.server.url, pid=self.server.pid if self.server.alive else None)

    async def idle_kv(self, timeout_s: float = 60.0) -> int | None:
        """KV blocks in use once nothing runs or waits (None if the server never went idle)."""
        s = await probe.wait_idle(self.client, self.server.url, None, None, timeout_s, time.perf_counter())
        return s.kv_used_blocks if s.idle else None


Drill = Callable[[DrillContext], Awaitable[DrillResult]]
MIB = 1 << 20


async def poll(predicate, timeout_s: float, every_s: float = 0.05):
    """Await `predicate()` (an async callable) until it returns something truthy; None on timeout."""
    deadline = time.perf_counter() + timeout_s
    while True:
        value = await predicate()
        if value or time.perf_counter() > deadline:
            return value or None
        await asyncio.sleep(every_s)



def new_drill_client(cfg: DrillConfig) -> httpx.AsyncClient:
    transport = BackoffTransport(limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))
    return httpx.AsyncClient(transport=transport, timeout=httpx.Timeout(cfg.timeout_s), trust_env=False)


# -- the table -----------------------------------------------------------------------------------------
COLUMNS = ("fault", "accepted", "completed", "aborted", "failed (clear error)", "cut by kill", "lost",
           "answered twice", "idle KV blocks", "recovery s", "result")


def row(r: DrillResult) -> list[str]:
    t = r.tally
    if r.skipped:
        return [r.fault, *["—"] * (len(COLUMNS) - 2), f"skipped: {r.skipped}"]
    return [r.fault, str(t.accepted), str(t["completed"]), str(t["aborted"]), str(t["failed"]), str(t["cut"]),
            str(t["lost"]), str(t.duplicated), "—" if r.kv_idle_blocks is None else str(r.kv_idle_blocks),
            "—" if r.recovery_s is None else f"{r.recovery_s:.2f}", r.verdict]


def markdown_table(results: list[DrillResult]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(row(r)) + " |" for r in results]
    return "\n".join(lines)


def check_lines(results: list[DrillResult]) -> list[str]:
    """Each drill's checks, one line each, for under the table."""
    out = []
    for r in results:
        for c in r.checks:
            out.append(f"{r.name}: {'ok ' if c.held else 'FAILED '}{c.what}{': ' + c.detail if c.detail else ''}")
        for msg, n in r.tally.messages.items():
            out.append(f"{r.name}: {n} × {msg}")
    return out

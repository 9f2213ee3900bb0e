"""Runs of `bench serve`: warm-up, dispatch on an arrival schedule under a concurrency cap, and sweeps.

The dispatcher sleeps until each request is due and starts it as a task; a task waits for a
concurrency slot, if capped, then streams. Each record keeps when the request was due and when
it went out, so a client that falls behind (coordinated omission) shows up as send lag instead
of hiding in the latencies. Records are computed after the run, so no tokenizer work competes
with the timing. Each run of a sweep gets fresh prompts (seed + run number): reusing them would
measure a server's prefix cache instead of its load behaviour.
"""
from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import httpx

from tokenfab.bench.agent import AgentConfig
from tokenfab.bench.aggregate import (Bucket, bucket_summaries, error_summary, make_buckets, summarize)
from tokenfab.bench.arrivals import arrival_times
from tokenfab.bench.client import Endpoint, RawResult, stream_request
from tokenfab.bench.datasets import BenchRequest, DatasetConfig, build_dataset
from tokenfab.bench.timing import RequestRecord, request_record
from tokenfab.bench.tokens import TokenCounter

# `--sweep auto`: after an unthrottled run measures the peak request rate P, these fractions of P.
AUTO_SWEEP_FRACTIONS = (0.25, 0.5, 0.75, 0.9, 1.0)


@dataclass(slots=True)
class ServeConfig:
    """Everything a `bench serve` invocation decides; the CLI flags map onto these one to one."""
    base_url: str
    model: str | None = None
    endpoint: str = "completions"
    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    num_prompts: int = 200
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    sweep: list[float] | str | None = None      # rates, "auto", or None for a single run
    warmup: int = 1
    slos: dict[str, float] = field(default_factory=dict)
    buckets: list[int] = field(default_factory=lambda: [128, 512, 2048, 8192])
    percentiles: list[float] = field(default_factory=lambda: [50.0, 90.0, 95.0, 99.0])
    seed: int = 0
    tokenizer: str | None = None
    api_key: str | None = None
    stream_usage: str = "continuous"
    ignore_eos: bool = True
    temperature: float = 0.0
    timeout_s: float = 600.0
    extra_body: dict = field(default_factory=dict)
    agent: AgentConfig | None = None            # the agent workload's settings, with --dataset agent


@dataclass(slots=True)
class RunResult:
    request_rate: float
    burstiness: float
    max_concurrency: int | None
    duration_s: float
    records: list[RequestRecord]
    summary: dict
    buckets: list[dict]
    errors: list[dict]
    warmup_failed: int = 0
    sessions: dict | None = None                # the agent workload's session figures (session_stats.py)


def new_client(max_concurrency: int | None, timeout_s: float) -> httpx.AsyncClient:
    # No pool limit: a request must never wait for a connection after its clock started.
    # trust_env=False: a benchmark of a local server must not detour through a proxy.
    return httpx.AsyncClient(timeout=httpx.Timeout(timeout_s),
                             limits=httpx.Limits(max_connections=None, max_keepalive_connections=max_concurrency or 256),
                             trust_env=False)


async def discover_model(base_url: str, api_key: str | None) -> str:
    """The first model the server lists, for when --model is not given."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        async with httpx.AsyncClient(timeout=10.0, trust_env=False) as c:
            r = await c.get(f"{base_url}/v1/models", headers=headers)
            r.raise_for_status()
            return r.json()["data"][0]["id"]
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as e:
        raise ValueError(f"could not list the models at {base_url}/v1/models ({type(e).__name__}: {e}); "
                         "is the server up? Pass --model NAME to skip this look-up") from None


async def run_once(client: httpx.AsyncClient, ep: Endpoint, requests: list[BenchRequest], *, rate: float,
                   burstiness: float, max_concurrency: int | None, seed: int,
                   on_done: Callable[[RawResult], None] | None = None,
                   clock: Callable[[], float] = time.perf_counter) -> tuple[list[tuple], float]:
    """Send `requests` on schedule. Returns ((request, raw, scheduled, slot_at) per request, run start)."""
    times = arrival_times(len(requests), rate, burstiness, seed)
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None

    async def one(req: BenchRequest, scheduled: float) -> tuple:
        if sem is not None:
            await sem.acquire()
        slot_at = clock()
        try:
            raw = await stream_request(client, ep, req, clock)
        finally:
            if sem is not None:
                sem.release()
        if on_done is not None:
            on_done(raw)
        return req, raw, scheduled, slot_at

    t0 = clock()
    tasks = []
    for req, at in zip(requests, times):
        delay = t0 + at - clock()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(req, t0 + at)))
    return await asyncio.gather(*tasks), t0


async def warm_up(client: httpx.AsyncClient, ep: Endpoint, requests: list[BenchRequest],
                  max_concurrency: int | None, clock: Callable[[], float] = time.perf_counter) -> list[RawResult]:
    """Uncounted requests first: connections, caches and lazy initialisation settle before timing."""
    if not requests:
        return []
    cap = min(max_concurrency or len(requests), len(requests))
    done, _ = await run_once(client, ep, requests, rate=math.inf, burstiness=1.0, max_concurrency=cap, seed=0,
                             clock=clock)
    return [raw for _, raw, _, _ in done]


def measure(ep: Endpoint, requests: list[BenchRequest], warm: list[BenchRequest], cfg: ServeConfig, rate: float,
            seed: int, counter: TokenCounter, buckets: list[Bucket], progress=None, *,
            clock: Callable[[], float] = time.perf_counter,
            run: Callable[[Awaitable], object] = asyncio.run) -> RunResult:
    """One timed run (after its warm-up), turned into records and aggregates.

    `run` drives the coroutine (asyncio.run); tests pass a virtual-clock loop's run_until_complete
    together with that loop's `time` as `clock`.
    """
    async def go():
        async with new_client(cfg.max_concurrency, cfg.timeout_s) as client:
            warm_raws = await warm_up(client, ep, warm, cfg.max_concurrency, clock)
            check_warm_up(warm_raws, ep)
            task = progress.start_run(rate, len(requests)) if progress else None
            done, t0 = await run_once(client, ep, requests, rate=rate, burstiness=cfg.burstiness,
                                      max_concurrency=cfg.max_concurrency, seed=seed, clock=clock,
                                      on_done=(lambda raw: progress.advance(task, raw)) if progress else None)
            return done, t0, clock() - t0, sum(r.error is not None for r in warm_raws)

    done, t0, duration, warm_failed = run(go())
    records = [request_record(i, req, raw, sched, slot_at, t0, counter)
               for i, (req, raw, sched, slot_at) in enumerate(done)]
    return RunResult(request_rate=rate, burstiness=cfg.burstiness, max_concurrency=cfg.max_concurrency,
                     duration_s=duration, records=records,
                     summary=summarize(records, duration, cfg.percentiles, cfg.slos),
                     buckets=bucket_summaries(records, buckets, cfg.percentiles, cfg.slos),
                     errors=error_summary(records), warmup_failed=warm_failed)


def check_warm_up(warm_raws: list[RawResult], ep: Endpoint) -> None:
    """A warm-up that failed entirely stops the benchmark with its error."""
    if warm_raws and all(r.error for r in warm_raws):
        raise ValueError(f"every warm-up request to {ep.url} failed, e.g. {warm_raws[0].error}"
                         + _hint(warm_raws[0].error, ep))


def _hint(error: str | None, ep: Endpoint) -> str:
    if error and error.startswith(("HTTP 400", "HTTP 422")) and ep.stream_usage == "continuous":
        return " (if the server rejects stream_options.continuous_usage_stats, try --stream-usage final)"
    if error and error.startswith(("HTTP 404",)):
        return f" (does the server serve /v1/{'chat/completions' if ep.kind == 'chat' else 'completions'}?)"
    return ""


def run_serve(cfg: ServeConfig, counter: TokenCounter, endpoint: Endpoint, progress=None,
              on_run: Callable[[RunResult], None] | None = None, *,
              clock: Callable[[], float] = time.perf_counter,
              run: Callable[[Awaitable], object] = asyncio.run) -> tuple[list[RunResult], dict]:
    """All runs of the invocation: one, a list of rates, or `auto`. Returns (runs, sweep info)."""
    buckets = make_buckets(cfg.buckets)

    def one(rate: float, k: int) -> RunResult:
        reqs = build_dataset(cfg.dataset, counter, cfg.num_prompts + cfg.warmup, cfg.seed + k)
        return measure(endpoint, reqs[cfg.warmup:], reqs[:cfg.warmup], cfg, rate, cfg.seed + k, counter,
                       buckets, progress, clock=clock, run=run)

    return sweep_runs(cfg, one, on_run)


def sweep_runs(cfg: ServeConfig, one: Callable[[float, int], RunResult],
               on_run: Callable[[RunResult], None] | None = None) -> tuple[list[RunResult], dict]:
    """The runs of a sweep, each made by `one(rate, run number)`: one run, a list of rates, or `auto`."""
    def run_one(rate: float, k: int) -> RunResult:
        result = one(rate, k)
        if on_run:
            on_run(result)
        return result

    if cfg.sweep is None:
        return [run_one(cfg.request_rate, 0)], {"mode": "single", "rates": [cfg.request_rate],
                                                 "saturation_request_rate": None}
    if cfg.sweep == "auto":
        peak_run = run_one(math.inf, 0)
        peak = peak_run.summary["request_throughput"] or 0.0
        if peak <= 0:
            raise ValueError("the unthrottled run completed no request, so there is no rate to sweep around; "
                             "see its errors above")
        rates = [round(f * peak, 4) for f in AUTO_SWEEP_FRACTIONS]
        runs = [peak_run] + [run_one(r, k + 1) for k, r in enumerate(rates)]
        best = max(r.summary["request_throughput"] or 0.0 for r in runs)
        return runs, {"mode": "auto", "rates": [math.inf] + rates, "saturation_request_rate": best}
    runs = [run_one(r, k) for k, r in enumerate(cfg.sweep)]
    return runs, {"mode": "list", "rates": list(cfg.sweep), "saturation_request_rate": None}

"""`tokenfab bench soak`: the soak loop. A mixed workload (soak_mix.py) runs against a server for
`duration_s`, cut into windows of `window_s`; drift.py judges the windows.

Each window:
1. dispatches requests until its time is up: closed-loop with `max_concurrency` in flight, or, with a
   finite `request_rate`, on gamma arrivals (arrivals.py's process) under that cap;
2. waits for its requests to finish (so a window lasts its time plus the longest request left);
3. samples the server once it is idle (probe.py): RSS, threads, open descriptors, KV blocks in use.

Requests reuse the `bench serve` pieces: the client (client.py) times each chunk, timing.py turns a
request into its TTFT / TPOT / E2E, aggregate.py gives the percentiles. TTFT, TPOT and ITL cover
completed streamed requests; E2E covers every completed request, streamed or not. A request the client
hung up on purpose counts as `aborted`, neither completed nor failed. A failure is counted by its HTTP
status, or by `timeout`, `transport` (the connection failed), `stream` (an error inside a 200 stream)
or `invalid_output` (a finished structured answer that breaks its schema).
"""
from __future__ import annotations

import asyncio
import dataclasses
import math
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from tokenfab.bench import probe
from tokenfab.bench.aggregate import error_summary, latency_stats
from tokenfab.bench.client import RawResult, plain_request, stream_request
from tokenfab.bench.drift import Thresholds, Verdict, WindowStats
from tokenfab.bench.probe import ServerSample
from tokenfab.bench.schema import result_header
from tokenfab.bench.serving import new_client
from tokenfab.bench.soak_mix import SoakMix, SoakRequest, SoakWorkload, structured_error
from tokenfab.bench.timing import request_record
from tokenfab.bench.tokens import TokenCounter

SCHEMA = "tokenfab.bench.soak"
SCHEMA_VERSION = 1


@dataclass(slots=True)
class SoakConfig:
    """Everything a `bench soak` invocation decides; the CLI flags map onto these."""
    base_url: str
    model: str | None = None
    api_key: str | None = None
    tokenizer: str | None = None
    duration_s: float = 3600.0
    window_s: float = 300.0
    max_concurrency: int = 4
    request_rate: float = math.inf
    mix: SoakMix = field(default_factory=SoakMix)
    stream_usage: str = "continuous"
    temperature: float = 0.0
    timeout_s: float = 600.0
    idle_timeout_s: float = 60.0           # how long a window's end waits for the server to go idle
    pid: int | None = None                 # a local server process to read from /proc
    percentiles: list[float] = field(default_factory=lambda: [50.0, 90.0, 99.0])
    seed: int = 0
    thresholds: Thresholds = field(default_factory=Thresholds)

    @property
    def num_windows(self) -> int:
        return int(self.duration_s / self.window_s + 1e-9)

    def validate(self) -> None:
        """ValueError naming the flag to change."""
        if not self.window_s > 0:
            raise ValueError(f"--window {self.window_s:g} s: must be positive")
        if not self.duration_s >= self.window_s:
            raise ValueError(f"--duration {self.duration_s:g} s is shorter than one --window ({self.window_s:g} s)")
        if self.max_concurrency < 1:
            raise ValueError(f"--max-concurrency {self.max_concurrency}: need at least 1")
        if not self.idle_timeout_s > 0:
            raise ValueError(f"--idle-timeout {self.idle_timeout_s:g} s: must be positive")
        if not self.percentiles or not all(0 < p <= 100 for p in self.percentiles):
            raise ValueError(f"--percentiles {self.percentiles}: each must be in (0, 100]")
        self.mix.validate()
        th = self.thresholds
        need = th.warmup_windows + max(th.consecutive, 2)
        if th.warmup_windows >= 0 and th.consecutive >= 1 and self.num_windows < need:
            raise ValueError(f"--duration {self.duration_s:g} s in --window {self.window_s:g} s gives "
                             f"{self.num_windows} window(s), but --warmup-windows {th.warmup_windows} and "
                             f"--consecutive {th.consecutive} need {need} (at least 2 judged windows fit an RSS "
                             "slope); lengthen the duration or shorten the window")
        th.validate(self.num_windows)


@dataclass(slots=True)
class WindowResult:
    index: int
    start_s: float                         # since the soak started
    load_end_s: float                      # its last request finished
    requests: int
    completed: int
    aborted: int                           # the client hung up on purpose
    failed: int
    errors: dict[str, int]                 # failures by status (see the module docstring)
    error_messages: list[dict]             # failures by message, most frequent first
    kinds: dict[str, int]                  # requests by kind (soak_mix.SoakRequest.kind)
    output_tokens: int
    latency: dict[str, float | None]       # mean_/median_/std_/pP_ × ttft, tpot, itl, e2el (ms)
    server: ServerSample                   # sampled once idle, after the load

    def stats(self) -> WindowStats:
        s = self.server
        return WindowStats(index=self.index, end_s=s.t_s, requests=self.requests, failed=self.failed,
                           errors=dict(self.errors), p99_ttft_ms=self.latency.get("p99_ttft_ms"),
                           p99_tpot_ms=self.latency.get("p99_tpot_ms"), rss_bytes=s.rss_bytes,
                           kv_resident_bytes=s.kv_resident_bytes, threads=s.threads,
                           open_fds=s.open_fds, kv_used_blocks=s.kv_used_blocks)


@dataclass(slots=True)
class SoakRun:
    start: ServerSample                    # idle, before any load
    windows: list[WindowResult]


def error_status(raw: RawResult) -> str:
    """How a failure is counted: its HTTP status, or what went wrong without one."""
    if raw.status is not None and raw.status != 200:
        return str(raw.status)
    err = raw.error or ""
    if err.startswith("timed out"):
        return "timeout"
    if err.startswith("structured output"):
        return "invalid_output"
    if raw.status == 200:
        return "stream"
    return "transport"


def percentiles_of(cfg: SoakConfig) -> list[float]:
    """The asked percentiles, with P99 always in: drift judges it."""
    return sorted(set(cfg.percentiles) | {99.0})


def summarize_window(index: int, done: list[tuple[SoakRequest, RawResult, float, float]], start: float,
                     t0: float, server: ServerSample, counter: TokenCounter,
                     percentiles: list[float]) -> WindowResult:
    """A window from its requests: (request, result, due, slot) with perf_counter times; `start` is when the
    window began and `t0` when the soak did."""
    aborted = [raw for _, raw, _, _ in done if raw.hung_up and raw.error is None]
    kept = [(sr, raw, due, slot) for sr, raw, due, slot in done if not (raw.hung_up and raw.error is None)]
    records = [(sr, request_record(i, sr.req, raw, due, slot, start, counter))
               for i, (sr, raw, due, slot) in enumerate(kept)]
    failures = [raw for _, raw, _, _ in kept if raw.error is not None]
    ok = [rec for _, rec in records if rec.success]
    latency = latency_stats([rec for sr, rec in records if sr.stream and rec.success], percentiles)
    latency.update({k: v for k, v in latency_stats(ok, percentiles).items() if k.endswith("_e2el_ms")})
    ends = [raw.end for _, raw, _, _ in done]
    return WindowResult(
        index=index, start_s=start - t0, load_end_s=(max(ends) if ends else start) - t0, requests=len(done),
        completed=len(ok), aborted=len(aborted), failed=len(failures),
        errors=dict(Counter(error_status(raw) for raw in failures).most_common()),
        error_messages=error_summary([rec for _, rec in records]),
        kinds=dict(sorted(Counter(sr.kind for sr, _, _, _ in done).items())),
        output_tokens=sum(rec.output_len for rec in ok), latency=latency, server=server)


async def dispatch(client, cfg: SoakConfig, workload: SoakWorkload, deadline: float, seed: int,
                   clock: Callable[[], float], on_request: Callable[[RawResult], None] | None,
                   stop: asyncio.Event | None = None) -> list[tuple]:
    """Start requests until `deadline` (or until `stop` is set: the fault drills' background load), then
    wait for them all."""
    stopped = (lambda: False) if stop is None else stop.is_set
    sem = asyncio.Semaphore(cfg.max_concurrency)
    paced = math.isfinite(cfg.request_rate)
    gaps = np.random.default_rng(seed)

    async def one(sr: SoakRequest, due: float, slot: float) -> tuple:
        try:
            if sr.stream:
                raw = await stream_request(client, sr.endpoint, sr.req, clock, sr.hang_up_after)
            else:
                raw = await plain_request(client, sr.endpoint, sr.req, clock)
        finally:
            sem.release()
        if sr.structured and raw.error is None and not raw.hung_up:
            raw.error = structured_error("".join(e.text for e in raw.events), raw.finish_reason)
        if on_request is not None:
            on_request(raw)
        return sr, raw, due, slot

    tasks = []
    due = clock()
    while True:
        if paced and due > clock():
            await asyncio.sleep(min(due, deadline) - clock())
        if clock() >= deadline or stopped():
            break
        await sem.acquire()
        slot = clock()
        if slot >= deadline or stopped():
            sem.release()
            break
        tasks.append(asyncio.create_task(one(workload.next(), due if paced else slot, slot)))
        if paced:
            due += float(gaps.exponential(1.0 / cfg.request_rate))
    return list(await asyncio.gather(*tasks))


async def run_soak(cfg: SoakConfig, workload: SoakWorkload, counter: TokenCounter,
                   on_window: Callable[[WindowResult], None] | None = None,
                   on_request: Callable[[RawResult], None] | None = None,
                   clock: Callable[[], float] = time.perf_counter) -> SoakRun:
    """The whole soak: an idle sample first, then the windows one after another."""
    pcts = percentiles_of(cfg)
    async with new_client(cfg.max_concurrency, cfg.timeout_s) as client:
        t0 = clock()
        start = await probe.wait_idle(client, cfg.base_url, cfg.api_key, cfg.pid, cfg.idle_timeout_s, t0, clock)
        windows: list[WindowResult] = []
        for i in range(cfg.num_windows):
            w_start = clock()
            done = await dispatch(client, cfg, workload, w_start + cfg.window_s, cfg.seed + i, clock, on_request)
            server = await probe.wait_idle(client, cfg.base_url, cfg.api_key, cfg.pid, cfg.idle_timeout_s, t0, clock)
            windows.append(summarize_window(i, done, w_start, t0, server, counter, pcts))
            if on_window is not None:
                on_window(windows[-1])
    return SoakRun(start, windows)


def config_json(cfg: SoakConfig) -> dict:
    d = {k: getattr(cfg, k) for k in ("base_url", "model", "duration_s", "window_s", "max_concurrency",
                                       "stream_usage", "temperature", "timeout_s", "idle_timeout_s", "pid",
                                       "percentiles", "seed")}
    d["request_rate"] = "inf" if math.isinf(cfg.request_rate) else cfg.request_rate
    d["num_windows"] = cfg.num_windows
    d["mix"] = dataclasses.asdict(cfg.mix)
    d["thresholds"] = dataclasses.asdict(cfg.thresholds)
    return d   # the API key is never written


def result_json(cfg: SoakConfig, counter: TokenCounter, run: SoakRun, verdict: Verdict) -> dict:
    """The JSON result (docs/bench.md, "bench soak"): settings, the idle start, every window, the verdict."""
    windows = []
    for w, holds, checks in zip(run.windows, verdict.holds, verdict.windows):
        row = dataclasses.asdict(w)
        row["holds"] = holds
        row["checks"] = [dataclasses.asdict(c) for c in checks]
        windows.append(row)
    return {
        **result_header(config_json(cfg), counter, SCHEMA, SCHEMA_VERSION),
        "start": dataclasses.asdict(run.start),
        "windows": windows,
        "drift": {"passed": verdict.passed, "checks": [dataclasses.asdict(c) for c in verdict.checks]},
    }


"""Runs of the agent workload (agent.py): sessions dispatched on the arrival schedule, turns in order.

Sessions arrive as requests do in serving.py (`--request-rate`, gamma gaps of shape `--burstiness`,
or all at once), and `--max-concurrency` caps the sessions in flight: a session holds its slot from
its first turn to its last, think times included, as a user's agent does. Within a session each turn
is one streamed request through client.py, sent after the previous reply ended and the think time
passed. A turn that fails ends its session (the history cannot go on without the reply).

Each turn is an ordinary request record (timing.py), so the run's summary, buckets and errors are
those of any run; the session figures (session_stats.py) come on top. Token counts, including the
prefix each prompt shares with those sent before it, are measured after the run, so no tokenizer work
competes with the timing. The server's prefix-cache counters are read around the timed run, after
the warm-up.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import httpx

from tokenfab.bench import prefix_cache
from tokenfab.bench.agent import AgentWorkload, SessionPlan, build_workload, first_messages, next_messages
from tokenfab.bench.aggregate import bucket_summaries, error_summary, make_buckets, summarize
from tokenfab.bench.arrivals import arrival_times
from tokenfab.bench.client import Endpoint, RawResult, stream_request
from tokenfab.bench.datasets import BenchRequest, DatasetConfig, build_dataset
from tokenfab.bench.serving import RunResult, ServeConfig, check_warm_up, new_client, sweep_runs, warm_up
from tokenfab.bench.session_stats import SentPrefixes, TurnRecord, session_summary
from tokenfab.bench.timing import request_record
from tokenfab.bench.tokens import TokenCounter


@dataclass(slots=True)
class SentTurn:
    session: int
    turn: int              # 1-based
    request: BenchRequest
    raw: RawResult
    scheduled: float       # the clock when it was due: the session's arrival, or the reply's end + think time
    slot_at: float         # the clock when its session held a concurrency slot


async def run_sessions(client: httpx.AsyncClient, ep: Endpoint, w: AgentWorkload, *, rate: float, burstiness: float,
                       max_concurrency: int | None, seed: int, on_done: Callable[[RawResult], None] | None = None,
                       clock: Callable[[], float] = time.perf_counter) -> tuple[list[SentTurn], float]:
    """Every session's turns on schedule. Returns (the turns sent, in no particular order; the run start)."""
    times = arrival_times(len(w.sessions), rate, burstiness, seed)
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    sent: list[SentTurn] = []

    async def session(plan: SessionPlan, due: float) -> None:
        if sem is not None:
            await sem.acquire()
        slot_at = clock()
        try:
            messages, raw = first_messages(w, plan), None
            for k in range(plan.turns):
                if raw is not None:
                    due = raw.end + plan.think_s[k]
                    await asyncio.sleep(max(0.0, due - clock()))
                    messages = next_messages(messages, raw, plan, k)
                    slot_at = due
                req = BenchRequest(None, messages, 0, plan.output_lens[k], f"s{plan.index}-t{k + 1}",
                                   tools=w.tools or None)
                raw = await stream_request(client, ep, req, clock)
                sent.append(SentTurn(plan.index, k + 1, req, raw, due, slot_at))
                if on_done is not None:
                    on_done(raw)
                if raw.error is not None:
                    break
        finally:
            if sem is not None:
                sem.release()

    t0 = clock()
    tasks = []
    for plan, at in zip(w.sessions, times):
        delay = t0 + at - clock()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(session(plan, t0 + at)))
    await asyncio.gather(*tasks)
    return sent, t0


def turn_records(sent: list[SentTurn], w: AgentWorkload, t0: float, counter: TokenCounter) -> list[TurnRecord]:
    """Request records by (session, turn), with each prompt's exact length and its new tokens."""
    in_send_order = sorted(sent, key=lambda s: (s.raw.sent, s.session, s.turn))
    ids = counter.chat_ids([s.request.messages for s in in_send_order], w.tools or None)
    seen, new = SentPrefixes(), {}
    for s, prompt in zip(in_send_order, ids):
        s.request.prompt_len = len(prompt)
        new[(s.session, s.turn)] = len(prompt) - seen.add(prompt)
    ordered = sorted(sent, key=lambda s: (s.session, s.turn))
    return [TurnRecord(s.session, s.turn, request_record(i, s.request, s.raw, s.scheduled, s.slot_at, t0, counter),
                       new[(s.session, s.turn)]) for i, s in enumerate(ordered)]


def measure_sessions(ep: Endpoint, w: AgentWorkload, warm: list[BenchRequest], cfg: ServeConfig, rate: float,
                     seed: int, counter: TokenCounter, progress=None, *, clock: Callable[[], float] = time.perf_counter,
                     run: Callable[[Awaitable], object] = asyncio.run) -> RunResult:
    """One timed run of sessions (after its warm-up), turned into records, aggregates and session figures."""
    async def go():
        async with new_client(cfg.max_concurrency, cfg.timeout_s) as client:
            warm_raws = await warm_up(client, ep, warm, cfg.max_concurrency, clock)
            check_warm_up(warm_raws, ep)
            before = await prefix_cache.scrape(client, ep.base_url, ep.api_key)
            task = progress.start_run(rate, w.num_turns) if progress else None
            sent, t0 = await run_sessions(client, ep, w, rate=rate, burstiness=cfg.burstiness,
                                          max_concurrency=cfg.max_concurrency, seed=seed, clock=clock,
                                          on_done=(lambda raw: progress.advance(task, raw)) if progress else None)
            duration = clock() - t0
            after = await prefix_cache.scrape(client, ep.base_url, ep.api_key)
            return sent, t0, duration, sum(r.error is not None for r in warm_raws), prefix_cache.hit_rate(before, after)

    sent, t0, duration, warm_failed, cache = run(go())
    turns = turn_records(sent, w, t0, counter)
    records = [t.record for t in turns]
    return RunResult(request_rate=rate, burstiness=cfg.burstiness, max_concurrency=cfg.max_concurrency,
                     duration_s=duration, records=records,
                     summary=summarize(records, duration, cfg.percentiles, cfg.slos),
                     buckets=bucket_summaries(records, make_buckets(cfg.buckets), cfg.percentiles, cfg.slos),
                     errors=error_summary(records), warmup_failed=warm_failed,
                     sessions=session_summary(turns, [s.turns for s in w.sessions], [s.think_s for s in w.sessions],
                                              cfg.percentiles, cache))


def run_agent(cfg: ServeConfig, counter: TokenCounter, endpoint: Endpoint, progress=None,
              on_run: Callable[[RunResult], None] | None = None, *, clock: Callable[[], float] = time.perf_counter,
              run: Callable[[Awaitable], object] = asyncio.run) -> tuple[list[RunResult], dict]:
    """All runs of an agent invocation (one, or a list of session rates). Each run draws fresh sessions
    (seed + run number) and a fresh system prompt, so one run's prompts never hit the next one's cache.
    The warm-up sends `cfg.warmup` single-turn chats of unrelated text: it opens connections without
    caching the system prompt."""
    assert cfg.agent is not None and cfg.sweep != "auto"

    def one(rate: float, k: int) -> RunResult:
        w = build_workload(cfg.agent, counter, cfg.seed + k)
        warm = build_dataset(DatasetConfig(endpoint="chat", input_len=cfg.agent.user_len,
                                           output_len=cfg.agent.output_len, range_ratio=cfg.agent.range_ratio),
                             counter, max(cfg.warmup, 1), cfg.seed + k + 1_000_003)[:cfg.warmup]
        return measure_sessions(endpoint, w, warm, cfg, rate, cfg.seed + k, counter, progress, clock=clock, run=run)

    return sweep_runs(cfg, one, on_run)


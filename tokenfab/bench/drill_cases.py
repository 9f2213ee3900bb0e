"""The fault drills of `tokenfab bench drills`, their registry and the runner. Each runs the soak mix in
the background (drill_load.BackgroundLoad), does its harm, and fills a DrillResult row. The drills on
the data dir (sigkill, enospc, corrupt_sqlite) are in drill_data.py, the Ray one in drill_ray.py.

- disconnect:  hang up on a long prompt mid-prefill, and on another mid-stream; its KV must be freed at once
- slow_readers: streams read a few hundred bytes a second; the others' TPOT and the server's RSS must hold
- idle_connections: many TCP connections that send nothing; the load must still be served
- sigterm:     drain the requests in flight, then exit 0
- sigkill:     SIGKILL mid-batch and restart on the same --data-dir; every batch line answered once
- enospc:      the data dir's disk fills mid-batch; a clear error on the write, the job resumes with space
- corrupt_sqlite: a corrupt or foreign batch.sqlite at start; a clear error naming the file
- ray_replica: one of two Ray Serve replicas SIGKILLed; none lost, the pool back to two
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import resource
import signal
import socket
import time
from collections.abc import Callable

from tokenfab.bench.aggregate import latency_stats
from tokenfab.bench.client import ChunkEvent, RawResult, stream_request
from tokenfab.bench.datasets import BenchRequest
from tokenfab.bench.drill_data import corrupt_sqlite, enospc, sigkill
from tokenfab.bench.drill_load import outcome
from tokenfab.bench.drill_ray import ray_replica
from tokenfab.bench.drills import MIB, DrillContext, DrillResult, new_drill_client, poll
from tokenfab.bench.timing import request_record

BLOCK = 16                                    # tokenfab's default KV block size, in tokens


def raise_fd_limit(want: int) -> int:
    """Raise this process's soft descriptor limit towards `want` (children inherit it); the new limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = want if hard == resource.RLIM_INFINITY else min(want, hard)
    if target > soft:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]



def _probe_prompt(n: int, seed: int) -> list[int]:
    """Token ids no other request shares, so no prefix-cache hit shortens the prefill."""
    return [100 + (seed * 7919 + i * 37) % 5000 for i in range(n)]


# -- disconnect -------------------------------------------------------------------------------------

async def _cut_probe(ctx: DrillContext, where: str, seed: int, result: DrillResult, step: list[float]) -> RawResult:
    """A long streamed prompt, hung up on mid-prefill or after two content chunks; checks its blocks are
    freed by the engine's next turn. An abort lands between steps, so "at once" is the rest of the step
    under way plus one more: the bound is two steps (timed by the prefill's progress) and 250 ms."""
    cfg = ctx.cfg
    body = {"model": ctx.model, "prompt": _probe_prompt(cfg.probe_tokens, 1000 + seed), "max_tokens": 32,
            "stream": True, "ignore_eos": True, "temperature": 0}
    full = -(-cfg.probe_tokens // BLOCK)
    chunk = cfg.max_num_batched_tokens // BLOCK
    # Blocks the load may take meanwhile: each request in flight at most a long prompt and its answer.
    slack = cfg.concurrency * -(-(int(cfg.mix.long_input_len) + 32) // BLOCK)
    before = (await ctx.sample()).kv_used_blocks or 0
    raw = RawResult(sent=time.perf_counter())
    held = at_cut = 0
    async with ctx.client.stream("POST", f"{ctx.server.url}/v1/completions", json=body) as resp:
        raw.status = resp.status_code
        if resp.status_code != 200:
            raw.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
            raw.end = time.perf_counter()
            return raw
        if where == "prefill":
            async def in_prefill():
                s = await ctx.sample()
                return s if (s.kv_used_blocks or 0) - before >= 2 * chunk else None
            s = await poll(in_prefill, 60.0, 0.01)
            if s is not None:                  # the time per prefill chunk so far, queueing included
                step.append((time.perf_counter() - raw.sent) / (((s.kv_used_blocks or 0) - before) // chunk))
        else:
            chunks = 0
            async for line in resp.aiter_lines():
                chunks += line.startswith("data:") and '"text":""' not in line
                if chunks >= 2:
                    break
            s = await ctx.sample()
        if s is not None:
            at_cut = s.kv_used_blocks or 0
            held = at_cut - before
        raw.hung_up = True
    t_cut = time.perf_counter()                # leaving the block closed the connection
    raw.end = t_cut
    if where == "prefill":
        result.check("the hang-up came mid-prefill", 0 < held < full,
                     f"the probe held {held} of the {full} blocks its prompt needs")
    if held <= slack:
        result.check(f"mid-{where}: the probe held blocks to free", False, f"held {held}, noise {slack}")
        return raw

    async def freed():
        s = await ctx.sample()
        return (s.kv_used_blocks or 0) <= at_cut - held + slack
    ok = await poll(freed, 30.0, 0.01)
    free_s = time.perf_counter() - t_cut
    bound = 2 * max(step, default=1.0) + 0.25
    result.check(f"mid-{where}: KV freed by the engine's next turn", ok and free_s <= bound,
                 f"{held} blocks freed in {free_s * 1e3:.0f} ms (an engine step: {max(step, default=0) * 1e3:.0f} ms)"
                 if ok else f"{held} blocks still held after 30 s")
    result.recovery_s = max(result.recovery_s or 0.0, free_s)
    return raw


async def disconnect(ctx: DrillContext) -> DrillResult:
    result = DrillResult("disconnect", "client hangs up mid-prefill and mid-stream")
    await ctx.shared()
    async with ctx.load(seed=1) as load:
        await asyncio.sleep(1.0)
        step: list[float] = []                 # an engine step under this load, seconds
        for i, where in enumerate(("prefill", "stream")):
            result.tally.add(await _cut_probe(ctx, where, i, result, step))
        await asyncio.sleep(1.0)
    load.tally(into=result.tally)
    result.kv_idle_blocks = await ctx.idle_kv()
    return result


# -- slow readers -----------------------------------------------------------------------------------

async def _slow_stream(url: str, body: dict, bytes_per_s: int, slow: asyncio.Event, timeout_s: float) -> RawResult:
    """A streamed request over a raw socket with a 4 KiB receive buffer, read `bytes_per_s` while `slow`
    is set, then read to its end at full speed. A small asyncio buffer makes the back-pressure reach
    the server's socket."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    raw = RawResult(sent=time.perf_counter())
    data = bytearray()
    slow_bytes = 0
    try:
        await asyncio.get_running_loop().sock_connect(sock, (host, int(port)))
        reader, writer = await asyncio.open_connection(sock=sock, limit=256)
        payload = json.dumps(body).encode()
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (host.encode(), len(payload), payload))
        await writer.drain()
        step = max(1, bytes_per_s // 4)
        while slow.is_set():
            got = await asyncio.wait_for(reader.read(step), timeout_s)
            if not got:
                break
            data += got
            await asyncio.sleep(0.25)
        slow_bytes = len(data)
        while b"data: [DONE]" not in data:
            got = await asyncio.wait_for(reader.read(1 << 16), timeout_s)
            if not got:
                break
            data += got
        writer.close()
    except (OSError, asyncio.TimeoutError) as e:
        raw.error = f"{type(e).__name__}: {e}"
    raw.end = time.perf_counter()
    head = bytes(data[:64]).split(b"\r\n", 1)[0].split()
    if len(head) >= 2 and head[1].isdigit():
        raw.status = int(head[1])
    finish = data.rfind(b'"finish_reason":"')
    if finish >= 0:
        raw.finish_reason = bytes(data[finish + 17:data.index(b'"', finish + 17)]).decode()
    raw.events = [ChunkEvent(raw.end - raw.sent, "", data.count(b"data: {"))]
    raw.content = f"{len(data)} bytes, {slow_bytes} read slowly"
    if raw.error is None and (raw.status != 200 or b"data: [DONE]" not in data):
        raw.error = f"stream ended without [DONE] (status {raw.status})"
    return raw


def _send_queue_bytes(port: int) -> int | None:
    """Bytes the kernel holds unsent on the server's side of its TCP connections on `port` (the tx_queue
    of /proc/net/tcp{,6}): above 0 only while a reader falls behind. None without /proc."""
    total, seen = 0, False
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(name) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        seen = True
        for r in rows:
            parts = r.split()
            if len(parts) > 4 and int(parts[1].rsplit(":", 1)[1], 16) == port:
                total += int(parts[4].split(":")[0], 16)
    return total if seen else None


def _p50_tpot_ms(load, counter) -> float | None:
    recs = [request_record(i, sr.req, raw, raw.sent, raw.sent, 0.0, counter)
            for i, (sr, raw) in enumerate(load.results) if sr.stream and outcome(raw) == "completed"]
    return latency_stats(recs, [50.0])["p50_tpot_ms"]


async def _reader_phase(ctx: DrillContext, body: dict, slowly: bool, seed: int) -> dict:
    """The load with `cfg.slow_readers` extra streams of `body`, read slowly for `load_s` and then at full
    speed (`slowly`), or at full speed throughout: the same work for the engine either way, so the load's
    TPOT compares fairly between the two."""
    cfg = ctx.cfg
    slow = asyncio.Event()
    if slowly:
        slow.set()
    out = {"rss_peak": 0, "sendq": 0, "running": None}
    async with ctx.load(seed=seed) as load:
        readers = [asyncio.create_task(_slow_stream(ctx.server.url, body, cfg.slow_read_bytes_per_s, slow,
                                                    cfg.timeout_s)) for _ in range(cfg.slow_readers)]
        t_end = time.perf_counter() + cfg.load_s
        while time.perf_counter() < t_end:
            s = await ctx.sample()         # KV pages become resident as blocks are first used: not the readers'
            out["rss_peak"] = max(out["rss_peak"], (s.rss_bytes or 0) - (s.kv_resident_bytes or 0))
            out["sendq"] = max(out["sendq"], _send_queue_bytes(ctx.server.port) or 0)
            await asyncio.sleep(0.25)
        out["running"] = (await ctx.sample()).running
        slow.clear()                           # the readers catch up: each must reach its [DONE]
        t_release = time.perf_counter()
        out["readers"] = await asyncio.gather(*readers)
        out["release_s"] = time.perf_counter() - t_release
    out["load"] = load
    return out


async def slow_readers(ctx: DrillContext) -> DrillResult:
    cfg = ctx.cfg
    result = DrillResult("slow_readers", f"{cfg.slow_readers} streams read at {cfg.slow_read_bytes_per_s} B/s")
    await ctx.shared()
    # Top-20 logprobs make each chunk about a kilobyte, so a reader this slow fills the socket buffers
    # within seconds and the server's writes for it block: each answer (about 300 KiB) is larger than the
    # kernel's send buffer and uvicorn's write buffer (64 KiB) together.
    body = {"model": ctx.model, "prompt": "Tell me a long story about the sea.", "max_tokens": 320, "logprobs": 20,
            "stream": True, "ignore_eos": True, "temperature": 0,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    fast = await _reader_phase(ctx, body, False, seed=2)
    slow = await _reader_phase(ctx, body, True, seed=3)
    for phase in (fast, slow):
        for raw in phase["readers"]:
            result.tally.add(raw)
        phase["load"].tally(into=result.tally)
    before, during = _p50_tpot_ms(fast["load"], ctx.counter), _p50_tpot_ms(slow["load"], ctx.counter)
    if before and during:
        result.check(f"other streams' P50 TPOT with slow readers at most {cfg.max_tpot_ratio:g}x with fast ones",
                     during <= cfg.max_tpot_ratio * before, f"{before:.1f} ms → {during:.1f} ms")
    else:
        result.check("streams completed beside fast and slow readers", False, f"P50 TPOT {before} → {during}")
    done = slow["readers"]
    result.check("the slow readers each got their whole answer", all(outcome(r) == "completed" for r in done),
                 f"{sum(outcome(r) == 'completed' for r in done)}/{len(done)} ({done[0].content}); {slow['running']} "
                 f"requests running while they read slowly; {slow['release_s']:.1f} s to read the rest")
    if _send_queue_bytes(ctx.server.port) is not None:
        result.check("back-pressure reached the server (unsent bytes queued on its sockets)", slow["sendq"] > 0,
                     f"at most {slow['sendq'] / 1024:.0f} KiB queued (fast readers: {fast['sendq'] / 1024:.0f} KiB)")
    if fast["rss_peak"]:
        growth = (slow["rss_peak"] - fast["rss_peak"]) / MIB
        result.check(f"server RSS (less the KV pool's resident pages) with slow readers at most "
                     f"{cfg.max_rss_growth_mib:g} MiB above with fast ones", growth < cfg.max_rss_growth_mib,
                     f"peak {fast['rss_peak'] / MIB:.0f} MiB → {slow['rss_peak'] / MIB:.0f} MiB")
    result.kv_idle_blocks = await ctx.idle_kv()
    return result


# -- idle connections -------------------------------------------------------------------------------

def _still_open(sock: socket.socket) -> bool:
    try:
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) != b""
    except BlockingIOError:
        return True
    except OSError:
        return False


async def idle_connections(ctx: DrillContext) -> DrillResult:
    cfg = ctx.cfg
    want = cfg.idle_connections
    raise_fd_limit(want + 1024)
    result = DrillResult("idle_connections", f"{want} idle TCP connections")
    server = await ctx.shared()
    base_fds = (await ctx.sample()).open_fds or 0
    socks: list[socket.socket] = []
    error = ""
    loop = asyncio.get_running_loop()
    async with ctx.load(seed=4) as load:
        await asyncio.sleep(0.5)
        for _ in range(want):
            s = socket.socket()
            s.setblocking(False)
            try:
                await loop.sock_connect(s, ("127.0.0.1", server.port))
            except OSError as e:
                s.close()
                error = f"{type(e).__name__}: {e}"
                break
            socks.append(s)
        during = await ctx.sample()
        t_health = time.perf_counter()
        health = (await ctx.client.get(f"{server.url}/health")).status_code
        health_s = time.perf_counter() - t_health
        await asyncio.sleep(cfg.load_s)
        still = sum(_still_open(s) for s in socks)
    for s in socks:
        s.close()
    t_closed = time.perf_counter()
    result.fault = f"{len(socks)} idle TCP connections"
    load.tally(into=result.tally)
    result.check(f"{want} connections opened", len(socks) == want,
                 f"{len(socks)} opened" + (f"; the next failed: {error}" if error else ""))
    result.check("the server held them (its descriptors rose)", (during.open_fds or 0) - base_fds >= 0.9 * len(socks),
                 f"{base_fds} → {during.open_fds} open descriptors; {still} still open after {cfg.load_s:g} s")
    result.check("/health answered while they were open", health == 200, f"{health} in {health_s * 1e3:.0f} ms")
    result.check("the load was served meanwhile", result.tally["completed"] > 0,
                 f"{result.tally['completed']} requests completed")

    async def fds_back():
        return ((await ctx.sample()).open_fds or 0) <= base_fds + 8
    back = await poll(fds_back, 30.0, 0.1)
    result.recovery_s = time.perf_counter() - t_closed
    result.check("descriptors back to the baseline once closed", back, f"in {result.recovery_s:.2f} s")
    result.kv_idle_blocks = await ctx.idle_kv()
    return result


# -- SIGTERM ----------------------------------------------------------------------------------------

SIGNAL_GRACE_S = 0.2


async def sigterm(ctx: DrillContext) -> DrillResult:
    cfg = ctx.cfg
    result = DrillResult("sigterm", "SIGTERM under load")
    server = await ctx.shared()
    ep = ctx.endpoint()
    longs = []
    async with ctx.load(seed=5) as load:
        await asyncio.sleep(1.0)
        longs = [asyncio.create_task(stream_request(ctx.client, ep, BenchRequest(f"Story {i}: once upon a time",
                                                                                 None, 8, 48, "long")))
                 for i in range(3)]
        await poll(lambda: _running_at_least(ctx, 3), 30.0, 0.05)
        kv_busy = (await ctx.sample()).kv_used_blocks
        t_term = time.perf_counter()
        server.send(signal.SIGTERM)
        rc = await server.wait_exit(cfg.shutdown_timeout_s + 15)
        drain_s = time.perf_counter() - t_term
        long_raws = await asyncio.gather(*longs)
    for raw in long_raws:
        result.tally.add(raw)
    load.tally(into=result.tally)
    in_flight = [raw for _, raw in load.results if raw.sent < t_term < raw.end] + list(long_raws)
    finished = [raw for raw in in_flight if outcome(raw) in ("completed", "aborted")]
    result.check("exit status 0", rc == 0, f"exit {rc} after {drain_s:.2f} s")
    result.check("every request in flight at SIGTERM finished", len(finished) == len(in_flight),
                 f"{len(finished)}/{len(in_flight)} ({kv_busy} KV blocks in use at SIGTERM)")
    # the signal reaches the server's loop a moment after kill(2): a request sent in that moment may still be
    # taken and answered, which loses nothing; past it, every request is refused or told 503
    late = [raw for _, raw in load.results if raw.sent > t_term + SIGNAL_GRACE_S]
    result.check("requests after SIGTERM refused or told 503", all(outcome(r) in ("refused", "failed") for r in late),
                 f"{len(late)} sent {SIGNAL_GRACE_S:g} s or more after it")
    if rc is None:
        server.stop()
    result.recovery_s = drain_s                # the drain; the supervisor's restart is not the server's doing
    return result


async def _running_at_least(ctx: DrillContext, n: int) -> bool:
    return ((await ctx.sample()).running or 0) >= n


DRILLS = {
    "disconnect": ("client disconnects mid-prefill and mid-stream", disconnect),
    "slow_readers": ("slow readers", slow_readers),
    "idle_connections": ("idle open connections", idle_connections),
    "sigterm": ("SIGTERM: drain, exit 0", sigterm),
    "sigkill": ("SIGKILL and restart with a batch in flight", sigkill),
    "enospc": ("disk full under the data dir", enospc),
    "corrupt_sqlite": ("corrupt or foreign SQLite at start", corrupt_sqlite),
    "ray_replica": ("a Ray Serve replica killed", ray_replica),
}





async def run_drill(ctx: DrillContext, name: str) -> DrillResult:
    """One drill by name (drill_cases.DRILLS), with its own client on the running loop."""
    t0 = time.perf_counter()
    async with new_drill_client(ctx.cfg) as client:
        ctx.client = client
        try:
            result = await DRILLS[name][1](ctx)
        finally:
            ctx.client = None
    result.seconds = time.perf_counter() - t0
    return result


def run_drills(ctx: DrillContext, names: list[str],
               on_result: Callable[[DrillResult], None] | None = None) -> list[DrillResult]:
    results = []
    with contextlib.closing(ctx):
        for name in names:
            results.append(asyncio.run(run_drill(ctx, name)))
            if on_result is not None:
                on_result(results[-1])
    return results

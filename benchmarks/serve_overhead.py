"""What HTTP costs: `tokenfab serve` against the offline engine doing the same work, on the bundled model.

For each concurrency level (default 1, 8, 32) the same requests run twice, back to back:
  1. through the server (a `tokenfab serve` subprocess on a free port), streamed by `tokenfab bench`'s
     client, with that many requests in flight;
  2. through LLMEngine in this process, keeping the same number of requests in flight.
Printed per level: output tok/s and median TTFT for each, and server / offline as ratios
(tok/s ratio below 1 and TTFT ratio above 1 are the HTTP overhead).

    python benchmarks/serve_overhead.py                          # concurrency 1, 8, 32
    python benchmarks/serve_overhead.py --concurrency 4 16 --output-tokens 64
"""
from __future__ import annotations

import os

# Until 2026-11-30 this set OMP_WAIT_POLICY=PASSIVE: engine steps ran 5-20x slower in one thread than
# in another. The cause was two OpenMP pools (libgomp throttles spinning when it holds more threads
# than cores); the server now releases its loader thread's pool, and the engine here runs in this
# process's only pool, so both sides keep OpenMP's default waiting.

import argparse  # noqa: E402
import asyncio  # noqa: E402
import re  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import httpx  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from tokenfab.bench.client import Endpoint, stream_request  # noqa: E402
from tokenfab.bench.datasets import BenchRequest  # noqa: E402

TOPICS = ["the sea", "a robot", "the moon", "a library", "winter", "a violin", "trains", "bees"]


def prompts(n: int) -> list[str]:
    return [f"Request {i}. Write a detailed essay about {TOPICS[i % len(TOPICS)]} and why it matters." for i in range(n)]


def start_server(engine_flags: list[str]) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "tokenfab.cli", "serve", "--port", "0", "--no-access-log",
                             "--log-level", "warning", *engine_flags],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    for line in proc.stdout:
        m = re.search(r"curl (http://\S+)/v1/chat/completions", line)
        if m:
            return proc, m.group(1)
    raise RuntimeError(f"the server exited with {proc.wait()} before it was ready")


async def run_server_level(url: str, model: str, texts: list[str], output_tokens: int, concurrency: int) -> dict:
    ep = Endpoint(base_url=url, model=model, stream_usage="final", ignore_eos=True)
    reqs = [BenchRequest(prompt=t, messages=None, prompt_len=0, output_len=output_tokens) for t in texts]
    queue = list(reqs)
    results = []
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        async def worker():
            while queue:
                results.append(await stream_request(client, ep, queue.pop(0)))

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    errors = [r.error for r in results if r.error]
    if errors:
        raise RuntimeError(f"{len(errors)} request(s) failed, e.g. {errors[0]}")
    tokens = sum(r.completion_tokens or 0 for r in results)
    return {"tok_s": tokens / wall, "ttft_ms": statistics.median(r.events[0].t for r in results) * 1e3,
            "tokens": tokens}


def run_offline_level(engine, texts: list[str], output_tokens: int, concurrency: int) -> dict:
    from tokenfab.sampling import SamplingParams
    params = SamplingParams(max_tokens=output_tokens, temperature=0, ignore_eos=True)
    pending = list(enumerate(texts))
    in_flight, ttfts, tokens = {}, [], 0
    t0 = time.perf_counter()
    while pending or in_flight:
        while pending and len(in_flight) < concurrency:
            i, text = pending.pop(0)
            rid = f"offline-{concurrency}-{i}"
            engine.add_request(rid, text, params)
            in_flight[rid] = time.perf_counter()
        for out in engine.step():
            if out.request_id in in_flight and out.outputs[0].token_ids and in_flight[out.request_id] is not None:
                ttfts.append(time.perf_counter() - in_flight[out.request_id])
                in_flight[out.request_id] = None
            if out.finished:
                tokens += len(out.outputs[0].token_ids)
                in_flight.pop(out.request_id, None)
    wall = time.perf_counter() - t0
    return {"tok_s": tokens / wall, "ttft_ms": statistics.median(ttfts) * 1e3, "tokens": tokens}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--requests-per-level", type=int, default=0,
                    help="requests per level (default: the concurrency, at least 3)")
    ap.add_argument("--output-tokens", type=int, default=24)
    ap.add_argument("--max-model-len", type=int, default=1024)
    args = ap.parse_args()
    levels = {c: prompts(args.requests_per_level or max(3, c)) for c in args.concurrency}
    console = Console(width=120)   # the table stays whole when piped to a file

    # Both engines are loaded first and each level runs on one right after the other, so a machine
    # whose load drifts (a shared box) skews both sides of a ratio alike. The idle server uses no CPU.
    console.print("loading the engine in-process and starting tokenfab serve ...")
    from tokenfab.config import EngineConfig
    from tokenfab.engine.engine import LLMEngine
    engine = LLMEngine(EngineConfig(max_model_len=args.max_model_len))
    proc, url = start_server(["--max-model-len", str(args.max_model_len)])
    server, offline = {}, {}
    try:
        model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        asyncio.run(run_server_level(url, model, prompts(2), 4, 1))      # warm-ups, not counted
        run_offline_level(engine, prompts(2), 4, 1)
        for c, texts in levels.items():
            server[c] = asyncio.run(run_server_level(url, model, texts, args.output_tokens, c))
            offline[c] = run_offline_level(engine, texts, args.output_tokens, c)
            console.print(f"  concurrency {c}: server {server[c]['tok_s']:.1f} tok/s, TTFT {server[c]['ttft_ms']:.0f} ms;"
                          f" offline {offline[c]['tok_s']:.1f} tok/s, TTFT {offline[c]['ttft_ms']:.0f} ms")
    finally:
        proc.terminate()
        proc.wait(60)

    table = Table(title=f"tokenfab serve vs the offline engine ({args.output_tokens} output tokens per request)")
    for col in ["concurrency", "requests", "server tok/s", "offline tok/s", "tok/s ratio",
                "server TTFT ms", "offline TTFT ms", "TTFT ratio"]:
        table.add_column(col, justify="right")
    for c, texts in levels.items():
        s, o = server[c], offline[c]
        table.add_row(str(c), str(len(texts)), f"{s['tok_s']:.1f}", f"{o['tok_s']:.1f}", f"{s['tok_s'] / o['tok_s']:.2f}",
                      f"{s['ttft_ms']:.0f}", f"{o['ttft_ms']:.0f}", f"{s['ttft_ms'] / o['ttft_ms']:.2f}")
    console.print(table)
    console.print("command: python " + " ".join(sys.argv))


if __name__ == "__main__":
    main()

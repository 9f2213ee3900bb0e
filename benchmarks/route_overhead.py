"""The Responses and Messages routes against chat completions for the same request: one `tokenfab serve`
on the bundled model, the same user message with greedy decoding and the same output limit through
/v1/chat/completions, /v1/responses and /v1/messages, not streamed, the three routes in turn for ROUNDS rounds.
Prints each route's median time to the last token, its output tokens, and its ratio to chat's.

    python benchmarks/route_overhead.py [--rounds 15] [--max-tokens 64]
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import httpx

from tokenfab.bench.local_server import serving

MESSAGE = "Write four lines about the sea, the wind and a lighthouse."


def bodies(model: str, n: int) -> dict[str, tuple[str, dict]]:
    user = [{"role": "user", "content": MESSAGE}]
    return {"chat": ("/v1/chat/completions", {"model": model, "messages": user, "max_tokens": n, "temperature": 0}),
            "responses": ("/v1/responses", {"model": model, "input": user, "max_output_tokens": n,
                                            "temperature": 0, "store": False}),
            "messages": ("/v1/messages", {"model": model, "messages": user, "max_tokens": n, "temperature": 0})}


def output_tokens(route: str, body: dict) -> int:
    u = body["usage"]
    return u["completion_tokens"] if route == "chat" else u["output_tokens"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d, serving(["--no-ui"], f"{d}/serve.log") as url, \
            httpx.Client(base_url=url, timeout=120, trust_env=False) as c:
        model = c.get("/v1/models").json()["data"][0]["id"]
        routes = bodies(model, args.max_tokens)
        times: dict[str, list[float]] = {r: [] for r in routes}
        tokens: dict[str, set[int]] = {r: set() for r in routes}
        for path, body in routes.values():                   # warm-up: each route once
            c.post(path, json=body).raise_for_status()
        for _ in range(args.rounds):
            for route, (path, body) in routes.items():
                t = time.perf_counter()
                r = c.post(path, json=body)
                times[route].append(time.perf_counter() - t)
                r.raise_for_status()
                tokens[route].add(output_tokens(route, r.json()))
    chat = statistics.median(times["chat"])
    print(f"{'route':<11}{'median s':>10}{'output tokens':>15}{'vs chat':>9}")
    for route, ts in times.items():
        m = statistics.median(ts)
        print(f"{route:<11}{m:>10.3f}{','.join(map(str, sorted(tokens[route]))):>15}{m / chat:>8.3f}x")


if __name__ == "__main__":
    main()

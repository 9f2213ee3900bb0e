"""The speculative workloads of benchmarks/speculative.py, over HTTP, against any OpenAI-compatible server.

Greedy chat completions (temperature 0, ignore_eos off, `max_tokens` each) of the copy-heavy and
open-ended prompts, one request at a time and `--streams` at once; prints output tok/s per
workload (completion_tokens from `usage` over wall time) as one JSON line per case, so that
benchmarks/speculative_vs_llama.sh can put tokenfab and llama-server side by side.

    python benchmarks/speculative_http.py --url http://127.0.0.1:8000 --label tokenfab-ngram
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import sys
import time

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from speculative import CHAT, COPY  # noqa: E402


def chat(client: httpx.Client, url: str, model: str, prompt: str, max_tokens: int) -> int:
    r = client.post(url + "/v1/chat/completions", timeout=600, json={
        "model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
        "temperature": 0, "seed": 0})
    r.raise_for_status()
    return r.json()["usage"]["completion_tokens"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", required=True, help="server root, e.g. http://127.0.0.1:8000")
    ap.add_argument("--label", default="server")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--prompts", type=int, default=2, help="prompts per workload, single stream")
    ap.add_argument("--streams", type=int, default=8)
    args = ap.parse_args()
    url = args.url.rstrip("/")
    with httpx.Client() as client:
        model = client.get(url + "/v1/models", timeout=60).json()["data"][0]["id"]
        chat(client, url, model, COPY[0], 8)                      # warm up
        for workload, prompts in (("copy-heavy", COPY), ("open-ended", CHAT)):
            t = time.perf_counter()
            n = sum(chat(client, url, model, p, args.tokens) for p in prompts[:args.prompts])
            single = n / (time.perf_counter() - t)
            batch = [prompts[i % len(prompts)] for i in range(args.streams)]
            t = time.perf_counter()
            with cf.ThreadPoolExecutor(args.streams) as pool:
                n = sum(pool.map(lambda p: chat(client, url, model, p, args.tokens), batch))
            many = n / (time.perf_counter() - t)
            print(json.dumps({"label": args.label, "workload": workload, "tok_s_1": round(single, 2),
                              f"tok_s_{args.streams}": round(many, 2)}), flush=True)


if __name__ == "__main__":
    main()

"""The server's prefix-cache hit rate over a run, read from its Prometheus `/metrics`.

tokenfab exports `tokenfab:prefix_cache_queries` and `tokenfab:prefix_cache_hits` (counters of prompt
tokens looked up in the cache and found there), vLLM the same names under `vllm:`; any prefix is read,
summed over label sets. The bench reads them before and after a run: the hit rate is Δhits / Δqueries,
so it covers that run's requests only (and whatever else the server served meanwhile). A server without
the counters (llama-server, or no /metrics at all) reports nothing, and the result says so.
"""
from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

NAMES = ("prefix_cache_queries", "prefix_cache_hits")


def parse(text: str) -> dict[str, float] | None:
    """{"prefix_cache_queries": …, "prefix_cache_hits": …} from Prometheus text, or None without both."""
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        short = fam.name.split(":", 1)[-1].removesuffix("_total")   # "_total" stays on an untyped family
        if short not in NAMES:
            continue
        for s in fam.samples:
            if s.name in (fam.name, fam.name + "_total"):     # not a _created timestamp
                out[short] = out.get(short, 0.0) + s.value
    return out if all(n in out for n in NAMES) else None


async def scrape(client: httpx.AsyncClient, base_url: str, api_key: str | None = None) -> dict[str, float] | None:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        r = await client.get(f"{base_url}/metrics", headers=headers, timeout=10.0)
        return parse(r.text) if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None


def hit_rate(before: dict[str, float] | None, after: dict[str, float] | None) -> dict | None:
    """`queries`, `hits` (tokens, between the scrapes) and `hit_rate`; None when not reported."""
    if before is None or after is None:
        return None
    queries = after["prefix_cache_queries"] - before["prefix_cache_queries"]
    hits = after["prefix_cache_hits"] - before["prefix_cache_hits"]
    return {"queries": int(queries), "hits": int(hits), "hit_rate": hits / queries if queries > 0 else None}

"""The server's speculative-decoding acceptance, read from its Prometheus `/metrics`.

`bench serve` scrapes the counters before and after its runs and reports the difference, so the
numbers cover the benchmark's own requests only. Works with tokenfab (`tokenfab:` prefix) and vLLM
(`vllm:`), which share the metric names; a server without them (or without /metrics) reports nothing.
"""
from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tokenfab.bench.client import normalize_base_url

NAMES = ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens")
PER_POS = "spec_decode_num_accepted_tokens_per_pos"


def scrape(base_url: str, api_key: str | None = None, timeout_s: float = 10.0) -> dict | None:
    """{counter: value, PER_POS: {position: value}} summed over label sets, or None when absent."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        r = httpx.get(normalize_base_url(base_url) + "/metrics", headers=headers, timeout=timeout_s)
        if r.status_code != 200:
            return None
        families = list(text_string_to_metric_families(r.text))
    except (httpx.HTTPError, ValueError):
        return None
    out: dict = {}
    for fam in families:
        short = fam.name.split(":", 1)[-1]
        for sample in fam.samples:
            if not sample.name.endswith("_total") and fam.type == "counter":
                continue                  # _created timestamps
            if short in NAMES:
                out[short] = out.get(short, 0.0) + sample.value
            elif short == PER_POS:
                pos = int(sample.labels.get("position", 0))
                out.setdefault(PER_POS, {})
                out[PER_POS][pos] = out[PER_POS].get(pos, 0.0) + sample.value
    return out if all(n in out for n in NAMES) else None


def acceptance(before: dict | None, after: dict | None) -> dict | None:
    """What happened between two scrapes: counts, the acceptance rate (accepted / drafted tokens),
    the mean accepted length (1 + accepted / drafts) and the rate per draft position. None if the
    server exposes no counters or drafted nothing."""
    if before is None or after is None:
        return None
    d = {n: after[n] - before[n] for n in NAMES}
    if d["spec_decode_num_draft_tokens"] <= 0:
        return None
    drafts = d["spec_decode_num_drafts"]
    per_pos_after, per_pos_before = after.get(PER_POS, {}), before.get(PER_POS, {})
    per_pos = [(per_pos_after[p] - per_pos_before.get(p, 0.0)) / drafts if drafts else None
               for p in sorted(per_pos_after)]
    return {"num_drafts": int(drafts), "num_draft_tokens": int(d["spec_decode_num_draft_tokens"]),
            "num_accepted_tokens": int(d["spec_decode_num_accepted_tokens"]),
            "acceptance_rate": d["spec_decode_num_accepted_tokens"] / d["spec_decode_num_draft_tokens"],
            "mean_accepted_length": 1 + d["spec_decode_num_accepted_tokens"] / drafts if drafts else None,
            "acceptance_rate_per_pos": per_pos}

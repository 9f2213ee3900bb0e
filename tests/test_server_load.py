"""Load with faults on the bundled model: 64 concurrent streams, a quarter hanging up at random points.

Every stream that stays must get exactly the greedy text `LLM.generate` gives for its prompt, in
full. The leavers ask for far more tokens than the others, so only an abort ends them early: afterwards
/metrics must show nothing running and no KV block held.
"""
from __future__ import annotations

import asyncio
import json
import random
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tokenfab import SamplingParams
from tokenfab.server.app import build_app
from tokenfab.server.config import ServerConfig
from tokenfab.server.launch import ServerThread

pytestmark = pytest.mark.timeout(600)

NUM_REQUESTS = 64
NUM_DISCONNECTS = NUM_REQUESTS // 4
MAX_TOKENS = 10
LEAVER_MAX_TOKENS = 1000        # a leaver that is not aborted would still be running when the test looks
PROMPTS = ["The capital of France is", "def add(a, b):", "Once upon a time", "The sky is blue because",
           "My favourite food is", "In 1492, Columbus", "Water boils at", "The quick brown fox"]


@pytest.fixture(scope="module")
def refs(bundled_llm):
    outs = bundled_llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True),
                                use_tqdm=False)
    return [o.outputs[0].text for o in outs]


@pytest.fixture(scope="module")
def server(bundled_llm, refs):
    with ServerThread(build_app(bundled_llm.engine, ServerConfig(access_log=False))) as srv:
        yield srv
    assert bundled_llm.engine.block_manager.num_used_blocks() == 0


def metrics(url: str) -> dict[str, float]:
    """Samples by name, and by name{finished_reason} for the per-reason counters."""
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for s in fam.samples:
            out[s.name] = out.get(s.name, 0.0) + s.value
            if "finished_reason" in s.labels:
                out[f"{s.name}{{{s.labels['finished_reason']}}}"] = s.value
    return out


async def one_stream(client: httpx.AsyncClient, prompt: str, hang_up_after: int | None) -> dict:
    """Stream a completion; with hang_up_after=k, close the connection after k chunks (0: right after headers)."""
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS if hang_up_after is None else LEAVER_MAX_TOKENS, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    text, finish, usage, done, chunks = "", None, None, False, 0
    async with client.stream("POST", "/v1/completions", json=body) as resp:
        assert resp.status_code == 200, await resp.aread()
        async for line in resp.aiter_lines():
            if hang_up_after is not None and chunks >= hang_up_after:
                return {"hung_up": True}
            if not line.startswith("data: "):
                continue
            chunks += 1
            if line == "data: [DONE]":
                done = True
                continue
            obj = json.loads(line[6:])
            if obj.get("usage"):
                usage = obj["usage"]
            for c in obj["choices"]:
                text += c["text"]
                finish = c["finish_reason"] or finish
    return {"hung_up": False, "text": text, "finish": finish, "usage": usage, "done": done}


def test_64_streams_with_a_quarter_hanging_up_leave_correct_outputs_and_no_blocks(server, refs):
    rng = random.Random(1234)
    leavers = set(rng.sample(range(NUM_REQUESTS), NUM_DISCONNECTS))
    plan = [(i, PROMPTS[i % len(PROMPTS)], rng.randint(0, MAX_TOKENS // 2) if i in leavers else None)
            for i in range(NUM_REQUESTS)]

    async def run_all():
        limits = httpx.Limits(max_connections=NUM_REQUESTS + 8)
        async with httpx.AsyncClient(base_url=server.url, timeout=300, limits=limits) as client:
            return await asyncio.gather(*(one_stream(client, p, k) for _, p, k in plan))

    results = asyncio.run(run_all())
    for (i, prompt, k), res in zip(plan, results):
        if k is not None:
            assert res["hung_up"]
            continue
        assert res["done"], f"request {i} got no [DONE]"
        assert res["finish"] == "length"
        assert res["text"] == refs[i % len(PROMPTS)], f"request {i} ({prompt!r}) got a different text"
        assert res["usage"]["completion_tokens"] == MAX_TOKENS

    deadline = time.monotonic() + 30
    while True:                                # aborts land at the engine's next turn
        m = metrics(server.url)
        idle = (m["tokenfab:num_requests_running"], m["tokenfab:num_requests_waiting"],
                m["tokenfab:kv_cache_usage_perc"]) == (0, 0, 0)
        if idle or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert m["tokenfab:num_requests_running"] == 0
    assert m["tokenfab:num_requests_waiting"] == 0
    assert m["tokenfab:kv_cache_usage_perc"] == 0, "KV blocks are still held after every request ended"
    assert m["tokenfab:request_success_total{abort}"] == NUM_DISCONNECTS
    assert m["tokenfab:request_success_total{length}"] == NUM_REQUESTS - NUM_DISCONNECTS

"""The OpenAI API over real HTTP on the bundled model: the official client, bad input, /metrics.

One server per module (uvicorn in a thread on a free port) around the test session's bundled engine.
Reference outputs from `LLM.generate` / `LLM.chat` are computed before the server starts, so the
engine is only ever driven by one thread at a time.
"""
from __future__ import annotations

import json

import httpx
import pytest
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

from tokenfab import SamplingParams
from tokenfab.server.app import build_app
from tokenfab.server.config import ServerConfig
from tokenfab.server.launch import ServerThread

pytestmark = pytest.mark.timeout(300)

PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "Name three colors."}]
MAX_TOKENS = 12
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def refs(bundled_llm):
    return {"completion": bundled_llm.generate(PROMPT, GREEDY, use_tqdm=False)[0],
            "chat": bundled_llm.chat(CHAT, GREEDY, use_tqdm=False)[0]}


@pytest.fixture(scope="module")
def server(bundled_llm, refs):
    app = build_app(bundled_llm.engine, ServerConfig(access_log=False))
    with ServerThread(app) as srv:
        yield srv
    assert bundled_llm.engine.block_manager.num_used_blocks() == 0


@pytest.fixture(scope="module")
def client(server) -> OpenAI:
    return OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


def greedy(**kw) -> dict:
    return {"temperature": 0, "max_tokens": MAX_TOKENS, "extra_body": {"ignore_eos": True}, **kw}


# -- the official client ----------------------------------------------------------------------

def test_models_lists_the_bundled_model_with_its_context_length(http, model):
    data = http.get("/v1/models").json()["data"]
    assert [m["id"] for m in data] == [model] == ["SmolLM2-135M-Instruct"]
    assert data[0]["max_model_len"] == 2048


def test_completion_greedy_text_equals_llm_generate(client, model, refs):
    ref = refs["completion"]
    r = client.completions.create(model=model, prompt=PROMPT, **greedy())
    assert r.choices[0].text == ref.outputs[0].text
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ref.prompt_token_ids), MAX_TOKENS)
    assert r.id.startswith("cmpl-") and r.object == "text_completion" and r.model == model and r.created > 0


def test_streamed_completion_joins_to_the_same_text_with_final_usage(client, model, refs):
    chunks = list(client.completions.create(model=model, prompt=PROMPT, stream=True,
                                            stream_options={"include_usage": True}, **greedy()))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == refs["completion"].outputs[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert not chunks[-1].choices and chunks[-1].usage.completion_tokens == MAX_TOKENS
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_greedy_text_equals_llm_chat_streamed_and_not(client, model, refs):
    want = refs["chat"].outputs[0].text
    r = client.chat.completions.create(model=model, messages=CHAT, **greedy())
    assert r.choices[0].message.content == want and r.choices[0].message.role == "assistant"
    assert r.usage.prompt_tokens == len(refs["chat"].prompt_token_ids)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    chunks = list(client.chat.completions.create(model=model, messages=CHAT, stream=True, **greedy()))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason == "length"


def test_raw_stream_has_no_empty_content_chunks_and_ends_with_done(http, model):
    body = {"model": model, "messages": CHAT, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}
    with http.stream("POST", "/v1/chat/completions", json=body) as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        events = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    for c in chunks[1:]:                      # after the role chunk: text, or the finish
        choice = c["choices"][0]
        assert choice["delta"].get("content") or choice["finish_reason"]


def test_n_gives_n_choices_each_finished_and_counted(client, model):
    r = client.completions.create(model=model, prompt=PROMPT, n=3, temperature=1.0, seed=7, max_tokens=6)
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert all(c.finish_reason in ("stop", "length") for c in r.choices)
    assert r.usage.completion_tokens >= 3
    finishes = {}
    for c in client.chat.completions.create(model=model, messages=CHAT, n=2, temperature=1.0, seed=7,
                                            max_tokens=6, stream=True):
        for ch in c.choices:
            if ch.finish_reason:
                finishes[ch.index] = ch.finish_reason
    assert sorted(finishes) == [0, 1]


def test_stop_string_ends_the_text_right_before_it(client, model, refs):
    ref_text = refs["completion"].outputs[0].text
    stop = ref_text.split()[1]                # a word from the middle of the greedy answer
    r = client.completions.create(model=model, prompt=PROMPT, stop=[stop], **greedy())
    assert r.choices[0].text == ref_text[:ref_text.index(stop)]
    assert r.choices[0].finish_reason == "stop"


def test_completion_logprobs_come_in_the_completions_format(client, model, refs):
    r = client.completions.create(model=model, prompt=PROMPT, logprobs=2, **greedy())
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == MAX_TOKENS
    assert "".join(lp.tokens) == r.choices[0].text
    assert all(x <= 0 for x in lp.token_logprobs)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(MAX_TOKENS)]
    for tok, chosen, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) >= 2 and max(top.values()) == pytest.approx(chosen)   # greedy picks the top token


def test_chat_logprobs_come_in_the_chat_format(client, model):
    # Few enough tokens that the answer has no end-of-turn token (its text would be skipped, not its logprob).
    r = client.chat.completions.create(model=model, messages=CHAT, logprobs=True, top_logprobs=3, **greedy(max_tokens=6))
    content = r.choices[0].logprobs.content
    assert r.choices[0].finish_reason == "length" and len(content) == 6
    assert "".join(c.token for c in content) == r.choices[0].message.content
    for c in content:
        assert len(c.top_logprobs) == 3
        values = [t.logprob for t in c.top_logprobs]
        assert values == sorted(values, reverse=True) and values[0] == pytest.approx(c.logprob)
        assert bytes(c.bytes).decode() == c.token


def test_token_id_prompts_give_the_same_text_as_the_string(client, model, refs, bundled_tokenizer):
    ids = list(bundled_tokenizer(PROMPT).input_ids)
    one = client.completions.create(model=model, prompt=ids, **greedy())
    assert one.choices[0].text == refs["completion"].outputs[0].text
    two = client.completions.create(model=model, prompt=[ids, ids[:3]], **greedy())
    assert sorted(c.index for c in two.choices) == [0, 1]
    assert two.choices[0].text == one.choices[0].text
    assert two.usage.prompt_tokens == len(ids) + 3


def test_echo_puts_the_prompt_in_front(client, model, refs):
    r = client.completions.create(model=model, prompt=PROMPT, echo=True, **greedy())
    assert r.choices[0].text == PROMPT + refs["completion"].outputs[0].text


def test_tokenize_and_detokenize_round_trip(http, bundled_tokenizer):
    r = http.post("/tokenize", json={"prompt": PROMPT}).json()
    assert r["tokens"] == list(bundled_tokenizer(PROMPT).input_ids) and r["count"] == len(r["tokens"])
    assert http.post("/detokenize", json={"tokens": r["tokens"]}).json()["prompt"] == PROMPT
    chat = http.post("/tokenize", json={"messages": CHAT}).json()
    assert chat["count"] > r["count"]
    assert http.get("/version").json()["version"]
    assert http.get("/health").status_code == 200


# -- bad input --------------------------------------------------------------------------------

LONG = "word " * 3000                          # > 2048 tokens
BAD_INPUTS = {
    "malformed json": ("/v1/completions", b'{"prompt": "hi", ', 400, None),
    "not an object": ("/v1/completions", b'["hi"]', 400, None),
    "non-utf8 bytes": ("/v1/completions", b'{"prompt": "\xff\xfe"}', 400, None),
    "missing prompt": ("/v1/completions", {"max_tokens": 2}, 400, "prompt"),
    "prompt of wrong type": ("/v1/completions", {"prompt": 42}, 400, "prompt"),
    "max_tokens of wrong type": ("/v1/completions", {"prompt": "hi", "max_tokens": "ten"}, 400, "max_tokens"),
    "negative max_tokens": ("/v1/completions", {"prompt": "hi", "max_tokens": -5}, 400, "max_tokens"),
    "huge max_tokens": ("/v1/completions", {"prompt": "hi", "max_tokens": 10**12}, 400, "max_tokens"),
    "negative temperature": ("/v1/completions", {"prompt": "hi", "temperature": -0.5}, 400, "temperature"),
    "temperature of wrong type": ("/v1/chat/completions", {"messages": CHAT, "temperature": "hot"}, 400,
                                  "temperature"),
    "unknown model": ("/v1/completions", {"model": "gpt-17", "prompt": "hi"}, 404, "model"),
    "prompt too long": ("/v1/completions", {"prompt": LONG, "max_tokens": 1}, 400, "prompt"),
    "chat prompt too long": ("/v1/chat/completions", {"messages": [{"role": "user", "content": LONG}]}, 400,
                             "messages"),
    "empty messages": ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    "invalid role": ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 400,
                     "messages[0].role"),
    "token id out of range": ("/v1/completions", {"prompt": [1, 10**9]}, 400, "prompt"),
    "huge logit_bias": ("/v1/completions", {"prompt": "hi", "logit_bias": {"5": 1e9}}, 400, "logit_bias"),
    "chat huge logit_bias": ("/v1/chat/completions", {"messages": CHAT, "logit_bias": {"5": -101}}, 400,
                             "logit_bias"),
    "logit_bias id out of range": ("/v1/completions", {"prompt": "hi", "logit_bias": {"99999999": 1}}, 400,
                                   "logit_bias"),
    "logit_bias key not an id": ("/v1/completions", {"prompt": "hi", "logit_bias": {"hello": 1}}, 400,
                                 "logit_bias"),
    "n over the cap": ("/v1/completions", {"prompt": "hi", "n": 100000}, 400, "n"),
    "chat n over the cap": ("/v1/chat/completions", {"messages": CHAT, "n": 129}, 400, "n"),
    "best_of unlike n": ("/v1/completions", {"prompt": "hi", "best_of": 10**6}, 400, "best_of"),
    "too many sequences": ("/v1/completions", {"prompt": ["hi"] * 100, "n": 20}, 400, "prompt"),
    "too many stop strings": ("/v1/completions", {"prompt": "hi", "stop": ["x"] * 1000}, 400, "stop"),
    "seed beyond 64 bits": ("/v1/completions", {"prompt": "hi", "seed": 2**80}, 400, "seed"),
    "logprobs over 20": ("/v1/completions", {"prompt": "hi", "logprobs": 10**6}, 400, "logprobs"),
    "chat max_tokens 0": ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 0}, 400, "max_tokens"),
    "unknown route": ("/v1/embeddings", {"input": "hi"}, 404, None),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_gets_status_and_openai_error_body_and_server_keeps_serving(http, model, case):
    path, body, status, param = BAD_INPUTS[case]
    if isinstance(body, bytes):
        r = http.post(path, content=body, headers={"content-type": "application/json"})
    else:
        r = http.post(path, json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"] and err["type"]
    assert "Traceback" not in r.text
    assert err["param"] == param
    assert isinstance(err["code"], str) and err["code"], err     # machine-readable, never null
    if case.endswith("too long") or case == "huge max_tokens":
        assert err["code"] == "context_length_exceeded"
    elif case == "best_of unlike n":
        assert err["code"] == "unsupported"
    elif param in ("logit_bias", "n", "stop", "seed", "logprobs", "max_tokens", "temperature"):
        assert err["code"] == "invalid_value", err
    if case == "prompt too long":
        assert "2048" in err["message"] and any(w.isdigit() and int(w) > 2048 for w in err["message"].split())
    ok = http.post("/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 1})
    assert ok.status_code == 200


def test_wrong_method_gets_405_in_openai_shape(http):
    r = http.get("/v1/completions")
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"


# -- /metrics ---------------------------------------------------------------------------------

def scrape(http) -> dict[str, float]:
    """Every sample, keyed by name plus its labels other than model_name."""
    out = {}
    for fam in text_string_to_metric_families(http.get("/metrics").text):
        for s in fam.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
            out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return out


def test_metrics_parse_with_design_names_and_counters_move(http, client, model, bundled_llm):
    before = scrape(http)
    for name in ["num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "engine_num_threads",
                 "prefix_cache_queries_total",
                 "prefix_cache_hits_total", "num_preemptions_total", "prompt_tokens_total",
                 "generation_tokens_total", "time_to_first_token_seconds_count",
                 "inter_token_latency_seconds_count", "e2e_request_latency_seconds_count",
                 "request_queue_time_seconds_count", "spec_decode_num_drafts_total",
                 "spec_decode_num_draft_tokens_total", "spec_decode_num_accepted_tokens_total"]:
        assert "tokenfab:" + name in before, name
    r = client.completions.create(model=model, prompt="Counting: one, two,", **greedy())
    after = scrape(http)

    def moved(name: str) -> float:
        return after.get("tokenfab:" + name, 0.0) - before.get("tokenfab:" + name, 0.0)

    assert moved("generation_tokens_total") == r.usage.completion_tokens
    assert moved("prompt_tokens_total") == r.usage.prompt_tokens
    assert moved("prefix_cache_queries_total") == r.usage.prompt_tokens
    assert moved("time_to_first_token_seconds_count") == 1
    assert moved("e2e_request_latency_seconds_count") == 1
    assert moved("inter_token_latency_seconds_count") == MAX_TOKENS - 1
    assert moved("request_success_total{finished_reason=length}") == 1
    assert after["tokenfab:num_requests_running"] == 0 and after["tokenfab:kv_cache_usage_perc"] == 0
    engine = bundled_llm.engine                  # the thread count the steps run on now, whoever set it
    threads = engine.thread_controller.threads if engine.thread_controller else engine.stats().num_threads
    assert after["tokenfab:engine_num_threads"] == threads >= 1


def test_metrics_show_the_process_and_the_kv_blocks_held(http, client, model, bundled_llm):
    """What a soak watches for drift: the server process's memory, threads and descriptors, and the KV
    blocks held, which fall back to 0 once no request is in flight."""
    from tokenfab.worker.memory import process_rss
    body = {"model": model, "prompt": "Counting: one, two,", "max_tokens": 48, "ignore_eos": True, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as r:
        held = None
        for line in r.iter_lines():
            if held is None and line.startswith("data: "):     # mid-stream: the request holds its blocks
                held = scrape(http)["tokenfab:kv_cache_used_blocks"]
    assert held is not None and held >= 1
    m = scrape(http)
    assert m["tokenfab:kv_cache_used_blocks"] == 0
    bm = bundled_llm.engine.block_manager
    assert m["tokenfab:kv_cache_num_blocks"] == bm.num_blocks
    # the pool's share used at least once: at least the blocks this request held, at most the whole pool
    assert held * bundled_llm.engine.kv_pool_bytes // bm.num_blocks <= m["tokenfab:kv_cache_touched_bytes"]
    assert m["tokenfab:kv_cache_touched_bytes"] <= bundled_llm.engine.kv_pool_bytes
    rss = process_rss()                          # the server runs in this process
    if rss is None:
        pytest.skip("no /proc: the process families are not exported here")
    assert abs(m["process_resident_memory_bytes"] - rss) < 0.1 * rss
    assert m["process_open_fds"] >= 3 and m["process_threads"] >= 2   # the engine runs on a thread of its own

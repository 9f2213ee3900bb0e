"""Scoring prompts over HTTP (what lm-eval's loglikelihood tasks send), /tokenizer_info, HEAD, and the
streamed chat's first chunk, on the bundled model (float32 weights) served in a thread.

The references are the offline engine's prompt logprobs (`SamplingParams(prompt_logprobs=...)`),
computed before the server starts so only one thread ever drives the engine.
"""
from __future__ import annotations

import json
import logging
import time

import httpx
import pytest

from tokenfab import SamplingParams
from tokenfab.server.app import build_app
from tokenfab.server.config import ServerConfig
from tokenfab.server.launch import ServerThread

pytestmark = pytest.mark.timeout(300)

CONTEXT = "Question: What is the capital of France?\nAnswer:"
CHOICES = [" Paris", " London", " Berlin"]


@pytest.fixture(scope="module")
def scored(bundled_llm):
    """Offline prompt logprobs of each context + choice, and its token ids."""
    tok = bundled_llm.engine
    out = {}
    for c in CHOICES:
        ids = tok.tokenize(CONTEXT + c)
        res = bundled_llm.generate([ids], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1),
                                   use_tqdm=False)[0]
        out[c] = (ids, res.prompt_logprobs)
    return out


@pytest.fixture(scope="module")
def server(bundled_llm, scored):
    app = build_app(bundled_llm.engine, ServerConfig(access_log=True))
    with ServerThread(app) as srv:
        yield srv
    assert bundled_llm.engine.block_manager.num_used_blocks() == 0


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


def _lm_eval_loglikelihood(choice: dict, ctxlen: int) -> tuple[float, bool]:
    """lm-eval's `local-completions` parse_logprobs (0.4.x), for max_tokens 1: the continuation's tokens
    are [ctxlen:-1] (the last one is the generated token)."""
    lps = choice["logprobs"]["token_logprobs"][ctxlen:-1]
    tops = choice["logprobs"]["top_logprobs"][ctxlen:-1]
    return sum(lps), all(lp == max(top.values()) for lp, top in zip(lps, tops))


def test_lm_eval_loglikelihood_request_equals_offline_prompt_logprobs(http, scored, bundled_llm):
    ctxlen = len(bundled_llm.engine.tokenize(CONTEXT))
    batch = [scored[c][0] for c in CHOICES]
    r = http.post("/v1/completions", json={"model": "SmolLM2-135M-Instruct", "prompt": batch, "max_tokens": 1,
                                           "logprobs": 1, "echo": True, "temperature": 0, "seed": 1234})
    assert r.status_code == 200, r.text
    choices = sorted(r.json()["choices"], key=lambda c: c["index"])
    assert len(choices) == 3
    for c, choice in zip(CHOICES, choices):
        ids, ref = scored[c]
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(ids) + 1 == len(lp["token_logprobs"]) == len(lp["text_offset"])
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        for i in range(1, len(ids)):
            assert abs(lp["token_logprobs"][i] - ref[i][ids[i]].logprob) < 1e-4
        ll, _ = _lm_eval_loglikelihood(choice, ctxlen)
        want = sum(ref[i][ids[i]].logprob for i in range(ctxlen, len(ids)))
        assert abs(ll - want) < 1e-4
        assert choice["text"].startswith(CONTEXT)
        # is_greedy: every continuation token was the most likely one
        _, greedy = _lm_eval_loglikelihood(choice, ctxlen)
        assert greedy == all(ref[i][ids[i]].rank == 1 for i in range(ctxlen, len(ids)))
    # The model prefers the right answer.
    lls = [_lm_eval_loglikelihood(ch, ctxlen)[0] for ch in choices]
    assert max(range(3), key=lambda i: lls[i]) == 0


def test_max_tokens_zero_with_echo_scores_the_prompt_alone(http, scored):
    ids, ref = scored[" Paris"]
    r = http.post("/v1/completions", json={"prompt": [ids], "max_tokens": 0, "logprobs": 2, "echo": True})
    assert r.status_code == 200, r.text
    body = r.json()
    (choice,) = body["choices"]
    assert choice["finish_reason"] == "length" and body["usage"]["completion_tokens"] == 0
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(ids) and lp["token_logprobs"][0] is None
    for i in range(1, len(ids)):
        assert abs(lp["token_logprobs"][i] - ref[i][ids[i]].logprob) < 1e-4
        assert 1 <= len(lp["top_logprobs"][i]) <= 3          # the top 2, plus the prompt token when not among them
    assert lp["text_offset"] == sorted(lp["text_offset"]) and lp["text_offset"][0] == 0


def test_streamed_echo_carries_the_prompt_logprobs_in_its_first_chunk(http, scored):
    ids, ref = scored[" Paris"]
    with http.stream("POST", "/v1/completions", json={"prompt": ids, "max_tokens": 2, "logprobs": 0, "echo": True,
                                                      "stream": True, "temperature": 0}) as r:
        assert r.status_code == 200
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    lps = chunks[0]["choices"][0]["logprobs"]
    assert lps["token_logprobs"][0] is None and len(lps["tokens"]) >= len(ids)
    assert abs(lps["token_logprobs"][1] - ref[1][ids[1]].logprob) < 1e-4
    assert sum(len(c["choices"][0]["logprobs"]["tokens"]) for c in chunks if c["choices"]) == len(ids) + 2


def test_string_prompt_list_with_echo_logprobs_gives_one_choice_per_prompt(http):
    r = http.post("/v1/completions", json={"prompt": ["Hello there", "One two three"], "max_tokens": 0,
                                           "echo": True, "logprobs": 0})
    assert r.status_code == 200, r.text
    texts = [c["text"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])]
    assert texts == ["Hello there", "One two three"]


def test_tokenizer_info_serves_what_lm_evals_remote_tokenizer_reads(http, bundled_tokenizer):
    info = http.get("/tokenizer_info").json()
    assert info["eos_token"] == bundled_tokenizer.eos_token and info["bos_token"] == bundled_tokenizer.bos_token
    assert info["chat_template"] == bundled_tokenizer.chat_template
    assert info["tokenizer_class"] and info["model_max_length"] == 2048
    # lm-eval encodes the eos token through /tokenize to find its id.
    ids = http.post("/tokenize", json={"prompt": info["eos_token"], "add_special_tokens": False}).json()["tokens"]
    assert ids == [bundled_tokenizer.eos_token_id]


@pytest.mark.parametrize("path", ["/metrics", "/health", "/v1/models", "/version", "/tokenizer_info", "/openapi.json"])
def test_head_is_allowed_wherever_get_is(http, path):
    get, head = http.get(path), http.head(path)
    assert get.status_code == head.status_code == 200
    assert head.content == b"" and head.headers["content-type"] == get.headers["content-type"]


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_streamed_chat_first_chunk_arrives_with_the_first_token(http):
    # A long prompt makes the prefill take a while; the role chunk must not go out before it ends.
    messages = [{"role": "user", "content": "Summarise this. " + "The quick brown fox jumps over the lazy dog. " * 30}]
    access, handler = logging.getLogger("tokenfab.access"), _Lines()
    access.addHandler(handler)
    level = access.level
    access.setLevel(logging.INFO)
    try:
        t0 = time.monotonic()
        with http.stream("POST", "/v1/chat/completions", json={"messages": messages, "max_tokens": 3,
                                                               "stream": True}) as r:
            first = None
            for line in r.iter_lines():
                if line.startswith("data: {") and first is None:
                    first = time.monotonic() - t0
                    assert json.loads(line[6:])["choices"][0]["delta"]["role"] == "assistant"
        deadline = time.monotonic() + 10      # the server logs once the response has ended
        while not any("/v1/chat/completions" in x for x in handler.lines) and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        access.removeHandler(handler)
        access.setLevel(level)
    line = next(x for x in handler.lines if "/v1/chat/completions" in x)
    server_ttft = float(line.split("ttft_ms=")[1].split()[0]) / 1e3
    # The client's clock starts before the server's and its first chunk follows the server's first token.
    print(f"client first chunk {first * 1e3:.1f} ms, server TTFT {server_ttft * 1e3:.1f} ms")
    assert first >= server_ttft
    assert first - server_ttft < 10        # a liveness bound only: the gap is the machine's, not the code's

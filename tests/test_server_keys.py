"""API keys with per-key limits (server/keys.py), through the official openai client: requests and tokens per
minute give 429s with Retry-After and the x-ratelimit-* headers, the largest max_tokens, the models and the
service classes a key may use; per-key counts in /metrics under the key's name, never the key; the flag
that puts /metrics and the web page behind a key; a bad keys file fails the CLI with a message."""
from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest

from tests.oracle import make_tiny_model
from tokenfab import LLM
from tokenfab.server.app import build_app
from tokenfab.server.config import ServerConfig
from tokenfab.server.keys import KeyPolicy, load_keys_file
from tokenfab.server.launch import ServerThread

openai = pytest.importorskip("openai", reason="the openai client (the test extra) is not installed")
pytestmark = pytest.mark.timeout(300)

POLICIES = [KeyPolicy("sk-rpm", "rpm", requests_per_minute=3),
            KeyPolicy("sk-tpm", "tpm", tokens_per_minute=20),
            KeyPolicy("sk-cap", "cap", max_tokens=4, models=("tiny",)),
            KeyPolicy("sk-batch", "batchonly", service_classes=("batch",))]


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture(scope="module")
def tiny_llm(tmp_path_factory, bundled_tokenizer):
    folder = tmp_path_factory.mktemp("keys-llama")
    make_tiny_model("llama", str(folder), bundled_tokenizer)
    llm = LLM(model=str(folder), max_model_len=128, num_kv_blocks=128, block_size=16)
    yield llm
    assert llm.engine.block_manager.num_used_blocks() == 0


@pytest.fixture(scope="module")
def server(tiny_llm):
    app = build_app(tiny_llm.engine, ServerConfig(access_log=False, served_model_names=["tiny"], api_keys=["sk-plain"],
                                                  key_policies=POLICIES))
    clock = Clock()
    app.state.tokenfab.metrics.key_limiter.clock = clock
    with ServerThread(app) as srv:
        yield srv.url, clock


def _client(url: str, key: str):
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0)


def test_requests_per_minute_give_429_with_retry_after_and_ratelimit_headers(server):
    url, clock = server
    c = _client(url, "sk-rpm")
    for i in range(3):
        raw = c.completions.with_raw_response.create(model="tiny", prompt="hi", max_tokens=1)
        assert raw.headers["x-ratelimit-limit-requests"] == "3"
        assert raw.headers["x-ratelimit-remaining-requests"] == str(2 - i)
    with pytest.raises(openai.RateLimitError) as e:
        c.completions.create(model="tiny", prompt="hi", max_tokens=1)
    h = e.value.response.headers
    assert h["x-ratelimit-remaining-requests"] == "0" and 0 < int(h["retry-after"]) <= 60
    assert float(h["x-ratelimit-reset-requests"].rstrip("s")) > 0
    assert e.value.body["code"] == "rate_limit_exceeded"
    other = _client(url, "sk-plain")           # another key is not limited by this one's window
    assert other.completions.create(model="tiny", prompt="hi", max_tokens=1).choices
    clock.t += 61                               # the window has room again
    assert c.completions.create(model="tiny", prompt="hi", max_tokens=1).choices


def test_tokens_per_minute_count_what_requests_used(server):
    url, clock = server
    c = _client(url, "sk-tpm")
    done = c.completions.create(model="tiny", prompt="one two three four five six", max_tokens=16)
    assert done.usage.total_tokens >= 20         # the first request fits the window; it uses it up
    with pytest.raises(openai.RateLimitError) as e:
        c.completions.create(model="tiny", prompt="hi", max_tokens=1)
    assert e.value.response.headers["x-ratelimit-remaining-tokens"] == "0"
    clock.t += 61
    assert c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=1).choices


def test_a_keys_largest_max_tokens_and_models(server):
    url, _ = server
    c = _client(url, "sk-cap")
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model="tiny", prompt="hi", max_tokens=10)
    assert e.value.body["param"] == "max_tokens" and "at most 4" in e.value.body["message"]
    out = c.completions.create(model="tiny", prompt="hi", extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 4     # no max_tokens given: the key's cap
    with pytest.raises(openai.PermissionDeniedError) as e:
        c.chat.completions.create(model="other", messages=[{"role": "user", "content": "hi"}])
    assert e.value.body["code"] == "model_not_allowed"


def test_a_keys_service_classes(server):
    url, _ = server
    c = _client(url, "sk-batch")
    with pytest.raises(openai.PermissionDeniedError) as e:
        c.completions.create(model="tiny", prompt="hi", max_tokens=1)
    assert e.value.body["param"] == "service_tier"
    assert c.completions.create(model="tiny", prompt="hi", max_tokens=1, extra_body={"service_tier": "flex"}).choices


def test_metrics_count_per_key_name_and_never_show_a_key(server):
    url, _ = server
    text = httpx.get(url + "/metrics", timeout=30).text       # public without --auth-all-routes
    assert 'tokenfab:api_key_rate_limited_total{key_name="rpm"}' in text
    assert 'tokenfab:api_key_limit{key_name="tpm",limit="tokens_per_minute"} 20.0' in text
    assert 'tokenfab:api_key_requests_total{key_name="cap"}' in text
    assert not any(p.key in text for p in POLICIES) and "sk-plain" not in text


def test_auth_all_routes_puts_metrics_and_the_page_behind_the_key(tiny_llm):
    app = build_app(tiny_llm.engine, ServerConfig(access_log=False, served_model_names=["tiny"], api_keys=["sk-x"],
                                                  auth_all_routes=True))
    with ServerThread(app) as srv:
        for path in ("/metrics", "/", "/version"):
            assert httpx.get(srv.url + path, timeout=30).status_code == 401, path
            assert httpx.get(srv.url + path, headers={"authorization": "Bearer sk-x"}, timeout=30).status_code == 200
        assert httpx.get(srv.url + "/health", timeout=30).status_code == 200


@pytest.mark.parametrize("doc,message", [
    ({"keys": []}, "at least one key"),
    ({"keys": [{"name": "x"}]}, "non-empty string 'key'"),
    ({"keys": [{"key": "a", "rpm": 3}]}, "unknown field"),
    ({"keys": [{"key": "a", "requests_per_minute": 0}]}, "positive integer"),
    ({"keys": [{"key": "a", "name": "n"}, {"key": "b", "name": "n"}]}, "used twice"),
])
def test_bad_keys_files_are_refused_naming_the_problem(tmp_path, doc, message):
    p = tmp_path / "keys.json"
    p.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match=message):
        load_keys_file(str(p))


def test_the_cli_fails_on_a_bad_keys_file_with_a_message(tmp_path):
    p = tmp_path / "keys.json"
    p.write_text("{not json")
    r = subprocess.run([sys.executable, "-m", "tokenfab", "serve", "--api-keys-file", str(p)], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode != 0 and "cannot read the keys file" in r.stderr and "Traceback" not in r.stderr

"""`tokenfab serve --reasoning-parser qwen3` on the bundled model, which does not think: the flag is
accepted, a reply without tags has `reasoning_content: null` and its whole text as content (streamed
too, with no reasoning deltas), `chat_template_kwargs` reach the template harmlessly, and /v1/messages
accepts `thinking: {"type": "enabled"}`. How tagged text is split is tested with scripted engine
outputs in test_reasoning_unit.py, through the same output path."""
from __future__ import annotations

import json

import httpx
import pytest

from serve_process import serve

pytestmark = pytest.mark.timeout(600)

ASK = [{"role": "user", "content": "Name three colors."}]


@pytest.fixture(scope="module")
def http(tmp_path_factory):
    with serve(tmp_path_factory.mktemp("reasoning") / "serve.log", "--reasoning-parser", "qwen3") as url:
        with httpx.Client(base_url=url, timeout=300, trust_env=False) as c:
            yield c


@pytest.fixture(scope="module")
def model(http) -> str:
    return http.get("/v1/models").json()["data"][0]["id"]


def chat(http, model, **kw) -> httpx.Response:
    return http.post("/v1/chat/completions", json={"model": model, "messages": ASK, "max_tokens": 12,
                                                    "temperature": 0, **kw})


@pytest.fixture(scope="module")
def whole(http, model) -> dict:
    r = chat(http, model)
    assert r.status_code == 200, r.text
    return r.json()


def test_a_reply_without_tags_has_no_reasoning_content(whole):
    message = whole["choices"][0]["message"]
    assert "reasoning_content" in message and message["reasoning_content"] is None
    assert isinstance(message["content"], str) and message["content"]


def test_streamed_reply_without_tags_sends_content_only(http, model, whole):
    with http.stream("POST", "/v1/chat/completions", json={"model": model, "messages": ASK, "max_tokens": 12,
                                                           "temperature": 0, "stream": True}) as r:
        assert r.status_code == 200
        lines = [ln.removeprefix("data: ") for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    deltas = [json.loads(ln)["choices"][0]["delta"] for ln in lines[:-1]]
    assert not any("reasoning_content" in d for d in deltas)
    assert "".join(d.get("content", "") for d in deltas) == whole["choices"][0]["message"]["content"]


def test_chat_template_kwargs_are_accepted_and_unknown_variables_are_harmless(http, model, whole):
    r = chat(http, model, chat_template_kwargs={"enable_thinking": False, "no_such_variable": 1})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == whole["usage"]["prompt_tokens"]   # SmolLM2 has no switch
    bad = chat(http, model, chat_template_kwargs={"tokenize": False})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "chat_template_kwargs.tokenize"


def test_messages_accepts_thinking_enabled_and_replies_without_a_thinking_block(http, model):
    r = http.post("/v1/messages", json={"model": model, "max_tokens": 12, "messages": ASK, "temperature": 0,
                                        "thinking": {"type": "enabled", "budget_tokens": 1024}})
    assert r.status_code == 200, r.text
    assert [b["type"] for b in r.json()["content"]] == ["text"]


def test_responses_accepts_a_reasoning_effort_and_replies_without_a_reasoning_item(http, model, whole):
    r = http.post("/v1/responses", json={"model": model, "max_output_tokens": 12, "input": ASK, "temperature": 0,
                                         "reasoning": {"effort": "low"}, "store": False})
    assert r.status_code == 200, r.text
    assert [x["type"] for x in r.json()["output"]] == ["message"]
    assert r.json()["output"][0]["content"][0]["text"] == whole["choices"][0]["message"]["content"]

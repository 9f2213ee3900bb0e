"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens) on a real `tokenfab serve` of the
bundled model, through the official `anthropic` client: whole and streamed replies, stop sequences, a
forced tool_use -> tool_result round trip, token counts, errors in Anthropic's shape, and x-api-key auth.

One server for the module, started with an API key, so every call here also goes through the key check
(the anthropic client sends its key as `x-api-key`).
"""
from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import pytest

from serve_process import serve
from tokenfab.server.messages import to_chat_request
from tokenfab.server.messages_protocol import MessagesRequest
from tokenfab.server.messages_reply import _Blocks, stop_reason

pytestmark = pytest.mark.timeout(600)

KEY = "sk-messages-test"
ASK = [{"role": "user", "content": "Name three colors."}]
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"name": "get_weather", "description": "Current weather in a city", "input_schema": WEATHER}]
FORCE = {"type": "tool", "name": "get_weather"}
GREEDY = {"temperature": 0}          # anthropic 2.x's create() has no temperature argument: sent as extra body
WEATHER_ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    with serve(tmp_path_factory.mktemp("messages") / "serve.log", "--api-key", KEY) as u:
        yield u


@pytest.fixture(scope="module")
def http(url):
    with httpx.Client(base_url=url, timeout=300, trust_env=False, headers={"x-api-key": KEY}) as c:
        yield c


@pytest.fixture(scope="module")
def model(http) -> str:
    return http.get("/v1/models").json()["data"][0]["id"]


@pytest.fixture(scope="module")
def client(url) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def whole(client, model):
    """A greedy reply to ASK, not streamed (the reference the streamed and stopped replies are held to)."""
    return client.messages.create(model=model, max_tokens=16, extra_body=GREEDY, messages=ASK,
                                  system=[{"type": "text", "text": "You are terse."}])


def text_of(message) -> str:
    return "".join(b.text for b in message.content if b.type == "text")


def assert_anthropic_error(response: httpx.Response, status: int, kind: str, *words: str) -> None:
    assert response.status_code == status, response.text
    body = response.json()
    assert body["type"] == "error" and body["error"]["type"] == kind, body
    for w in words:
        assert w in body["error"]["message"], body


def test_reply_is_a_message_with_text_and_usage(whole, model):
    assert whole.id.startswith("msg_") and whole.type == "message" and whole.role == "assistant"
    assert whole.model == model
    assert [b.type for b in whole.content] == ["text"] and text_of(whole)
    assert whole.stop_reason in ("end_turn", "max_tokens")
    assert 1 <= whole.usage.output_tokens <= 16
    assert (whole.stop_reason == "max_tokens") == (whole.usage.output_tokens == 16)


def test_streamed_text_equals_whole_text_and_events_come_in_order(client, model, whole):
    kinds, text, index = [], "", None
    with client.messages.stream(model=model, max_tokens=16, extra_body=GREEDY, messages=ASK,
                                system=[{"type": "text", "text": "You are terse."}]) as stream:
        for e in stream:
            if e.type not in ("text", "input_json"):       # the helper's own derived events
                kinds.append(e.type)
            if e.type == "content_block_start":
                index = e.index
            elif e.type == "content_block_delta":
                assert e.index == index and e.delta.type == "text_delta"
                text += e.delta.text
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert kinds[1:-2] == ["content_block_start"] + ["content_block_delta"] * (len(kinds) - 5) + ["content_block_stop"]
    assert text == text_of(whole)
    assert final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert final.usage.input_tokens == whole.usage.input_tokens


def test_stop_sequence_ends_the_reply_and_is_named(client, model, whole):
    words = text_of(whole).split()
    assert len(words) >= 2, text_of(whole)
    stop = " " + words[1]
    msg = client.messages.create(model=model, max_tokens=16, extra_body=GREEDY, messages=ASK, stop_sequences=[stop],
                                 system=[{"type": "text", "text": "You are terse."}])
    assert msg.stop_reason == "stop_sequence" and msg.stop_sequence == stop
    assert text_of(msg) == text_of(whole)[:text_of(whole).index(stop)]


def test_count_tokens_equals_the_prompt_tokens_of_the_reply(client, model, whole):
    count = client.messages.count_tokens(model=model, messages=ASK,
                                         system=[{"type": "text", "text": "You are terse."}])
    assert count.input_tokens == whole.usage.input_tokens


@pytest.fixture(scope="module")
def tool_call(client, model):
    return client.messages.create(model=model, max_tokens=64, extra_body=GREEDY, messages=WEATHER_ASK, tools=TOOLS,
                                  tool_choice=FORCE)


def test_forced_tool_call_is_a_tool_use_block_valid_against_its_schema(tool_call):
    assert tool_call.stop_reason == "tool_use"
    uses = [b for b in tool_call.content if b.type == "tool_use"]
    assert len(uses) == 1 and uses[0].name == "get_weather" and uses[0].id.startswith("toolu_")
    jsonschema.validate(uses[0].input, WEATHER)


def test_streamed_tool_call_sends_its_input_as_json_deltas(client, model, tool_call):
    deltas = []
    with client.messages.stream(model=model, max_tokens=64, extra_body=GREEDY, messages=WEATHER_ASK, tools=TOOLS,
                                tool_choice=FORCE) as stream:
        for e in stream:
            if e.type == "content_block_delta" and e.delta.type == "input_json_delta":
                deltas.append(e.delta.partial_json)
        final = stream.get_final_message()
    (use,) = [b for b in final.content if b.type == "tool_use"]
    (whole_use,) = [b for b in tool_call.content if b.type == "tool_use"]
    assert deltas and final.stop_reason == "tool_use"
    assert use.input == whole_use.input


def test_tool_result_round_trip_gets_a_reply_counted_like_count_tokens(client, model, tool_call):
    (use,) = [b for b in tool_call.content if b.type == "tool_use"]
    history = [*WEATHER_ASK, {"role": "assistant", "content": tool_call.content},    # as agents send it back
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                             "content": [{"type": "text", "text": "18 degrees and sunny"}]}]}]
    reply = client.messages.create(model=model, max_tokens=16, extra_body=GREEDY, messages=history, tools=TOOLS)
    assert reply.content and reply.stop_reason in ("end_turn", "max_tokens", "tool_use")
    count = client.messages.count_tokens(model=model, messages=history, tools=TOOLS)
    assert count.input_tokens == reply.usage.input_tokens
    first = client.messages.count_tokens(model=model, messages=WEATHER_ASK, tools=TOOLS)
    assert count.input_tokens > first.input_tokens      # the call and its result are in the prompt


@pytest.mark.parametrize("body, status, kind, words", [
    ({"messages": ASK}, 400, "invalid_request_error", ["max_tokens"]),
    ({"max_tokens": 8, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}]},
     400, "invalid_request_error", ["messages[0].content[0].type", "image"]),
    ({"max_tokens": 8, "messages": ASK, "thinking": {"type": "enabled", "budget_tokens": 1024}},
     400, "invalid_request_error", ["thinking"]),
    ({"max_tokens": 8, "messages": ASK,
      "tools": [{"type": "web_search_20250305", "name": "web_search", "input_schema": {}}]},
     400, "invalid_request_error", ["tools[0].type"]),
    ({"max_tokens": 8, "messages": ASK, "model": "no-such-model"}, 404, "not_found_error", ["no-such-model"]),
], ids=["missing-max-tokens", "image-block", "thinking", "server-tool", "unknown-model"])
def test_bad_input_is_a_4xx_in_anthropics_shape(http, model, body, status, kind, words):
    assert_anthropic_error(http.post("/v1/messages", json={"model": model, **body}), status, kind, *words)


def test_bad_json_is_a_400_in_anthropics_shape(http):
    r = http.post("/v1/messages", content=b'{"model": "x", "max_tokens": 8,',
                  headers={"content-type": "application/json"})
    assert_anthropic_error(r, 400, "invalid_request_error", "JSON")


def test_count_tokens_bad_input_is_a_400_in_anthropics_shape(http, model):
    r = http.post("/v1/messages/count_tokens", json={"model": model, "messages": []})
    assert_anthropic_error(r, 400, "invalid_request_error", "messages")


def test_the_client_raises_its_bad_request_error_with_the_body(client, model):
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model=model, max_tokens=8, messages=[{"role": "user", "content": [
            {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "hi"}}]}])
    error = e.value.body["error"]
    assert error["type"] == "invalid_request_error" and "document" in error["message"]


def test_wrong_or_missing_key_is_a_401_in_anthropics_shape(url, model):
    with httpx.Client(base_url=url, timeout=60, trust_env=False) as c:
        wrong = c.post("/v1/messages", json={"model": model, "max_tokens": 8, "messages": ASK},
                       headers={"x-api-key": "sk-wrong"})
        missing = c.post("/v1/messages/count_tokens", json={"model": model, "messages": ASK})
        openai_route = c.get("/v1/models", headers={"x-api-key": "sk-wrong"})
    assert_anthropic_error(wrong, 401, "authentication_error")
    assert_anthropic_error(missing, 401, "authentication_error", "x-api-key")
    assert openai_route.status_code == 401 and openai_route.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=url, api_key="sk-wrong", max_retries=0).messages.count_tokens(
            model=model, messages=ASK)


def test_the_key_works_as_a_bearer_token_and_x_api_key_works_on_openai_routes(url, model):
    bearer = anthropic.Anthropic(base_url=url, auth_token=KEY, max_retries=0, timeout=300)
    assert bearer.messages.count_tokens(model=model, messages=ASK).input_tokens > 0
    with httpx.Client(base_url=url, timeout=60, trust_env=False) as c:
        assert c.get("/v1/models", headers={"x-api-key": KEY}).status_code == 200


# -- the mapping and the event stream, without a server ------------------------------------------
def test_tool_results_become_tool_messages_in_place_and_tool_uses_tool_calls():
    req = MessagesRequest.model_validate({"model": "m", "max_tokens": 8, "system": [{"type": "text", "text": "S"}],
                                          "messages": [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": [
            {"type": "text", "text": "let me look"},
            {"type": "tool_use", "id": "toolu_1", "name": "w", "input": {"city": "Oslo"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "cold", "is_error": True},
            {"type": "text", "text": "and tomorrow?"}]}]})
    chat_req = to_chat_request(req)
    assert [m.as_template_input() for m in chat_req.messages] == [
        {"role": "system", "content": "S"}, {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "let me look", "tool_calls": [
            {"id": "toolu_1", "type": "function", "function": {"name": "w", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "content": "Error: cold", "tool_call_id": "toolu_1"},
        {"role": "user", "content": "and tomorrow?"}]


@pytest.mark.parametrize("finish, stopped_by, expected", [
    ("tool_calls", None, ("tool_use", None)), ("length", None, ("max_tokens", None)),
    ("stop", "END", ("stop_sequence", "END")), ("stop", 2, ("end_turn", None))])
def test_finish_reasons_map_to_stop_reasons(finish, stopped_by, expected):
    assert stop_reason(finish, stopped_by, ["END"]) == expected


def test_text_then_a_call_stream_as_two_blocks_each_started_and_stopped():
    blocks = _Blocks()
    events = blocks.feed({"content": "Hi"}) + blocks.feed({"tool_calls": [
        {"index": 0, "id": "call_ab", "type": "function", "function": {"name": "w", "arguments": '{"a"'}}]})
    events += blocks.feed({"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]}) + blocks.close()
    parsed = [(e.split("\n")[0].removeprefix("event: "), json.loads(e.split("\n")[1].removeprefix("data: ")))
              for e in events]
    assert [(name, data.get("index")) for name, data in parsed] == [
        ("content_block_start", 0), ("content_block_delta", 0), ("content_block_stop", 0),
        ("content_block_start", 1), ("content_block_delta", 1), ("content_block_delta", 1), ("content_block_stop", 1)]
    assert parsed[3][1]["content_block"] == {"type": "tool_use", "id": "toolu_ab", "name": "w", "input": {}}
    assert json.loads("".join(d["delta"]["partial_json"] for n, d in parsed if n == "content_block_delta"
                              and d["delta"]["type"] == "input_json_delta")) == {"a": 1}

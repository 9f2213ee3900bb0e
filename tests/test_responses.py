"""OpenAI's Responses API (/v1/responses) on a real `tokenfab serve` of the bundled model, through the
official `openai` client: whole and streamed replies (the typed events, numbered, adding up to the
reply), greedy equality with chat completions, a forced function call -> function_call_output round
trip through previous_response_id, a JSON-schema text.format, the stored responses (GET, DELETE,
input_items) surviving a restart on the same --data-dir, and 400s naming what tokenfab cannot honour.

One server for the module, on a data dir of its own; the last test restarts it on the same dir.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
from types import SimpleNamespace

import httpx
import jsonschema
import openai
import pytest
from openai import OpenAI

from serve_process import serve
from tokenfab.outputs import CompletionOutput, RequestOutput
from tokenfab.server.errors import APIError
from tokenfab.server.reasoning import parser_for
from tokenfab.server.reply import Reply
from tokenfab.server.responses_input import chat_messages, in_responses_terms, input_items, to_chat_request
from tokenfab.server.responses_protocol import ResponsesRequest
from tokenfab.server.responses_reply import ResponseEvents, output_items, response_events

pytestmark = pytest.mark.timeout(600)

ASK = "Name three colors."
TERSE = "You are terse."
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "name": "get_weather", "description": "Current weather in a city",
          "parameters": WEATHER, "strict": True}]
FORCE = {"type": "function", "name": "get_weather"}
WEATHER_ASK = "What is the weather like in Paris today?"
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}


class Server:
    """`tokenfab serve` on one data dir, which a test can restart (a new process, the same dir)."""

    def __init__(self, tmp, data_dir) -> None:
        self.tmp, self.data_dir, self.starts = tmp, data_dir, 0
        self.stack = contextlib.ExitStack()
        self.url = self._start()

    def _start(self) -> str:
        self.starts += 1
        return self.stack.enter_context(serve(self.tmp / f"serve-{self.starts}.log", "--data-dir", str(self.data_dir)))

    def restart(self) -> None:
        self.stack.close()
        self.stack = contextlib.ExitStack()
        self.url = self._start()

    def client(self) -> OpenAI:
        return OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("responses")
    s = Server(tmp, tmp / "data")
    yield s
    s.stack.close()


@pytest.fixture(scope="module")
def client(server) -> OpenAI:
    return server.client()


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


@pytest.fixture(scope="module")
def whole(client, model):
    """A greedy reply to ASK, not streamed (the reference the streamed reply is held to)."""
    return client.responses.create(model=model, input=ASK, instructions=TERSE, max_output_tokens=16, temperature=0)


def assert_openai_error(response: httpx.Response, status: int, param: str | None, *words: str) -> None:
    assert response.status_code == status, response.text
    err = response.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["param"] == param, err
    for w in words:
        assert w in err["message"], err


def test_reply_is_a_response_with_one_message_and_usage(whole, model):
    assert whole.id.startswith("resp_") and whole.object == "response" and whole.model == model
    assert [x.type for x in whole.output] == ["message"]
    (msg,) = whole.output
    assert msg.role == "assistant" and [p.type for p in msg.content] == ["output_text"] and whole.output_text
    assert 1 <= whole.usage.output_tokens <= 16
    assert whole.usage.total_tokens == whole.usage.input_tokens + whole.usage.output_tokens
    assert (whole.status == "incomplete") == (whole.usage.output_tokens == 16)
    if whole.status == "incomplete":
        assert whole.incomplete_details.reason == "max_output_tokens" and msg.status == "incomplete"


def test_greedy_reply_equals_chat_completions_for_the_same_messages(client, model, whole):
    chat = client.chat.completions.create(model=model, max_completion_tokens=16, temperature=0, messages=[
        {"role": "system", "content": TERSE}, {"role": "user", "content": ASK}])
    assert whole.output_text == chat.choices[0].message.content
    assert whole.usage.input_tokens == chat.usage.prompt_tokens
    assert whole.usage.output_tokens == chat.usage.completion_tokens


def test_streamed_events_are_numbered_in_order_and_their_deltas_add_up(client, model, whole):
    with client.responses.stream(model=model, input=ASK, instructions=TERSE, max_output_tokens=16,
                                 temperature=0) as stream:
        events = list(stream)
    final = events[-1].response      # the client's get_final_response() wants response.completed only
    kinds = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    last = "response.incomplete" if whole.status == "incomplete" else "response.completed"
    n = kinds.count("response.output_text.delta")
    assert n >= 1 and kinds == ["response.created", "response.in_progress", "response.output_item.added",
                                "response.content_part.added"] + ["response.output_text.delta"] * n + [
        "response.output_text.done", "response.content_part.done", "response.output_item.done", last]
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == final.output_text == whole.output_text
    assert events[-4].text == text and events[-2].item.content[0].text == text
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert events[0].response.status == "in_progress" and events[0].response.id == final.id


@pytest.fixture(scope="module")
def call(client, model):
    return client.responses.create(model=model, input=WEATHER_ASK, tools=TOOLS, tool_choice=FORCE,
                                   max_output_tokens=64, temperature=0)


def test_forced_call_is_a_function_call_item_valid_against_its_schema(call):
    (fc,) = [x for x in call.output if x.type == "function_call"]
    assert fc.name == "get_weather" and fc.call_id and fc.id.startswith("fc_") and call.status == "completed"
    jsonschema.validate(json.loads(fc.arguments), WEATHER)


def test_streamed_call_sends_its_arguments_as_deltas(client, model, call):
    with client.responses.stream(model=model, input=WEATHER_ASK, tools=TOOLS, tool_choice=FORCE,
                                 max_output_tokens=64, temperature=0) as stream:
        events = list(stream)
        final = stream.get_final_response()
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    (fc,) = [x for x in final.output if x.type == "function_call"]
    (whole_fc,) = [x for x in call.output if x.type == "function_call"]
    assert deltas == done.arguments == fc.arguments
    assert json.loads(fc.arguments) == json.loads(whole_fc.arguments)


def test_function_call_output_round_trip_through_previous_response_id(client, model, call):
    (fc,) = [x for x in call.output if x.type == "function_call"]
    reply = client.responses.create(model=model, previous_response_id=call.id, tools=TOOLS, max_output_tokens=16,
                                    temperature=0, input=[{"type": "function_call_output", "call_id": fc.call_id,
                                                           "output": "18 degrees and sunny"}])
    assert reply.previous_response_id == call.id and reply.output and reply.status in ("completed", "incomplete")
    assert reply.usage.input_tokens > call.usage.input_tokens      # the first turn is in the prompt
    items = client.responses.input_items.list(reply.id, order="asc").data
    assert [x.type for x in items] == ["message", "function_call", "function_call_output"]
    assert items[1].id == fc.id and items[2].call_id == fc.call_id
    # the same conversation sent whole, without previous_response_id, is the same prompt
    again = client.responses.create(model=model, tools=TOOLS, max_output_tokens=16, temperature=0, store=False,
                                    input=[{"role": "user", "content": WEATHER_ASK}, fc.model_dump(exclude_none=True),
                                           {"type": "function_call_output", "call_id": fc.call_id,
                                            "output": "18 degrees and sunny"}])
    assert again.usage.input_tokens == reply.usage.input_tokens and again.output_text == reply.output_text


def test_json_schema_text_format_gives_valid_json(client, model):
    r = client.responses.create(model=model, input="Invent a person.", max_output_tokens=64, temperature=0,
                                text={"format": {"type": "json_schema", "name": "person", "schema": PERSON,
                                                 "strict": True}})
    jsonschema.validate(json.loads(r.output_text), PERSON)
    assert r.text.format.type == "json_schema"


def test_stored_response_comes_back_lists_its_input_and_is_deleted(client, model, whole):
    got = client.responses.retrieve(whole.id)
    assert got.model_dump() == whole.model_dump()
    r = client.responses.create(model=model, max_output_tokens=2, temperature=0, metadata={"k": "v"}, input=[
        {"role": "developer", "content": TERSE}, {"role": "user", "content": [{"type": "input_text", "text": ASK}]},
        {"role": "assistant", "content": "Red."}, {"role": "user", "content": "More."}])
    assert r.metadata == {"k": "v"}
    asc = client.responses.input_items.list(r.id, order="asc").data
    assert [(x.role, x.content[0].text) for x in asc] == [("developer", TERSE), ("user", ASK), ("assistant", "Red."),
                                                           ("user", "More.")]
    desc = client.responses.input_items.list(r.id).data
    assert [x.id for x in desc] == [x.id for x in reversed(asc)]
    page = client.responses.input_items.list(r.id, order="asc", limit=2, after=asc[0].id)
    assert [x.id for x in page.data] == [asc[1].id, asc[2].id] and page.has_more
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.retrieve(r.id)
    assert e.value.body["param"] == "response_id" and r.id in e.value.body["message"]


def test_store_false_is_not_kept_and_an_unknown_previous_response_is_a_404(server, client, model):
    r = client.responses.create(model=model, input=ASK, max_output_tokens=2, store=False)
    assert r.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    response = httpx.post(server.url + "/v1/responses", json={"model": model, "input": ASK,
                                                              "previous_response_id": r.id})
    assert_openai_error(response, 404, "previous_response_id", r.id)


@pytest.mark.parametrize("extra, param, words", [
    ({"tools": [{"type": "web_search"}]}, "tools[0].type", ["web_search", "built-in"]),
    ({"tools": [{"type": "file_search", "vector_store_ids": ["vs_1"]}]}, "tools[0].type", ["file_search"]),
    ({"tools": [{"type": "code_interpreter", "container": {"type": "auto"}}]}, "tools[0].type", ["code_interpreter"]),
    ({"background": True}, "background", ["background"]),
    ({"include": ["reasoning.encrypted_content"]}, "include[0]", ["reasoning.encrypted_content"]),
    ({"include": ["file_search_call.results"]}, "include[0]", ["file_search_call.results"]),
    ({"conversation": "conv_1"}, "conversation", ["previous_response_id"]),
    ({"truncation": "auto"}, "truncation", ["auto"]),
    ({"reasoning": {"effort": "high"}}, "reasoning.effort", ["--reasoning-parser"]),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema", ["schema"]),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]},
     "input[0].content[0].type", ["input_image"]),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type", ["item_reference"]),
    ({"tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": []}}, "tool_choice", ["allowed_tools"]),
    ({"max_output_tokens": 0}, "max_output_tokens", ["max_output_tokens"]),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice.name", ["nope"]),
    ({"frobnicate": 1}, "frobnicate", ["not a known field"]),
], ids=["web-search", "file-search", "code-interpreter", "background", "include-encrypted", "include-other",
        "conversation", "truncation", "reasoning-without-parser", "schema-missing", "image-part", "item-reference",
        "allowed-tools", "max-output-tokens", "unknown-tool-choice", "unknown-field"])
def test_what_tokenfab_cannot_honour_is_a_400_naming_the_field(server, model, extra, param, words):
    response = httpx.post(server.url + "/v1/responses", json={"model": model, "input": ASK, **extra}, timeout=60)
    assert_openai_error(response, 400, param, *words)


def test_unknown_model_is_a_404_and_unknown_id_routes_are_404s(server):
    assert_openai_error(httpx.post(server.url + "/v1/responses", json={"model": "nope", "input": ASK}), 404, "model")
    for method in ("GET", "DELETE"):
        assert_openai_error(httpx.request(method, server.url + "/v1/responses/resp_nope"), 404, "response_id")
    assert_openai_error(httpx.get(server.url + "/v1/responses/resp_nope/input_items"), 404, "response_id")


def test_an_agents_sdk_agent_calls_its_tool_and_finishes(server, model):
    agents = pytest.importorskip("agents", reason="openai-agents (the test extra) is not installed")
    agents.set_tracing_disabled(True)              # no traces sent anywhere
    cities = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """Current weather in a city."""
        cities.append(city)
        return f"18 degrees and sunny in {city}"

    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=300)
    agent = agents.Agent(name="weather", instructions="Answer weather questions with the get_weather tool.",
                         tools=[get_weather], model=agents.OpenAIResponsesModel(model=model, openai_client=client),
                         # required on the first turn (a 135M model may not call on its own); the SDK
                         # resets it to auto after the call, so the second turn answers in text
                         model_settings=agents.ModelSettings(temperature=0, max_tokens=64, tool_choice="required",
                                                             parallel_tool_calls=False))
    result = agents.Runner.run_sync(agent, WEATHER_ASK, max_turns=4)
    kinds = [type(x).__name__ for x in result.new_items]
    assert kinds[:2] == ["ToolCallItem", "ToolCallOutputItem"] and kinds[-1] == "MessageOutputItem", kinds
    assert cities and all(isinstance(c, str) and c for c in cities)
    assert isinstance(result.final_output, str) and result.final_output


def test_a_stored_response_survives_a_restart_on_the_same_data_dir(server, model, whole):
    server.restart()
    client = server.client()
    assert client.responses.retrieve(whole.id).output_text == whole.output_text
    r = client.responses.create(model=model, previous_response_id=whole.id, input="One more.", max_output_tokens=4,
                                temperature=0)
    items = client.responses.input_items.list(r.id, order="asc").data
    assert [x.type for x in items] == ["message", "message", "message"]
    assert items[1].id == whole.output[0].id and items[2].content[0].text == "One more."


# -- the mapping and the events, without a server ---------------------------------------------------
def test_calls_join_the_assistant_turn_before_them_and_outputs_become_tool_messages():
    req = ResponsesRequest.model_validate({"input": [
        {"role": "user", "content": "Hi"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me look.",
                                                              "annotations": []}], "id": "msg_1", "status": None},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{\"a\": 1}"},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "function_call_output", "call_id": "c1", "output": [{"type": "input_text", "text": "one"}]},
        {"type": "function_call_output", "call_id": "c2", "output": "two"}]})
    items = input_items(req)
    assert items[1]["id"] == "msg_1" and all(x["id"] for x in items)
    msgs = chat_messages("Be brief.", items)
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "tool", "tool"]
    assert msgs[2]["content"] == "Let me look." and [c["id"] for c in msgs[2]["tool_calls"]] == ["c1", "c2"]
    assert msgs[3] == {"role": "tool", "tool_call_id": "c1", "content": "one"}


def test_chat_field_names_in_errors_become_the_responses_apis():
    e = in_responses_terms(APIError(400, "tools[1].function.parameters: bad", param="tools[1].function.parameters"))
    assert (e.message, e.param) == ("tools[1].parameters: bad", "tools[1].parameters")
    e = in_responses_terms(APIError(400, "max_completion_tokens must be at least 1", param="max_completion_tokens"))
    assert e.param == "max_output_tokens" and e.message.startswith("max_output_tokens")
    assert in_responses_terms(APIError(400, "prompt has 9 tokens", param="messages")).param == "input"


def _events(chunks: list[str]) -> list[dict]:
    return [json.loads(c.split("data: ", 1)[1]) for c in chunks]


def test_reasoning_then_text_then_a_call_stream_as_three_items_each_added_and_done():
    ev = ResponseEvents()
    out = ev.feed({"reasoning_content": "think"}, []) + ev.feed({"content": "Hi"}, [{"token": "Hi"}])
    out += ev.feed({"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                                    "function": {"name": "f", "arguments": "{\"a\""}}]}, [])
    out += ev.feed({"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]}, []) + ev.close()
    events = _events(out)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"].removeprefix("response.") for e in events] == [
        "output_item.added", "content_part.added", "reasoning_text.delta", "reasoning_text.done",
        "content_part.done", "output_item.done",
        "output_item.added", "content_part.added", "output_text.delta", "output_text.done", "content_part.done",
        "output_item.done",
        "output_item.added", "function_call_arguments.delta", "function_call_arguments.delta",
        "function_call_arguments.done", "output_item.done"]
    assert [x["type"] for x in ev.items] == ["reasoning", "message", "function_call"]
    assert ev.items[1]["content"][0] == {"type": "output_text", "text": "Hi", "annotations": [],
                                         "logprobs": [{"token": "Hi"}]}
    assert ev.items[2]["arguments"] == "{\"a\": 1}" and ev.items[2]["call_id"] == "call_1"
    whole = output_items({"content": "Hi", "reasoning_content": "think", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{\"a\": 1}"}}]}, "tool_calls",
        [{"token": "Hi"}])
    strip = [{k: v for k, v in x.items() if k != "id"} for x in whole]
    assert strip == [{k: v for k, v in x.items() if k != "id"} for x in ev.items]


def test_a_reply_with_neither_text_nor_calls_has_one_empty_message_streamed_or_not():
    ev = ResponseEvents()
    events = _events(ev.close("incomplete"))
    assert [e["type"] for e in events][-1] == "response.output_item.done"
    assert events[-1]["item"]["status"] == "incomplete" and events[-1]["item"]["content"][0]["text"] == ""
    (msg,) = output_items({"content": ""}, "length", [])
    assert msg["status"] == "incomplete" and msg["content"][0]["text"] == ""


THINKING_TOKENS = ["<th", "ink", ">\n", "Two ", "and two", ".\n</", "think", ">\n\n", "It is ", "4."]


def _scripted(pieces: list[str]):
    """An engine stream whose one choice writes `pieces`, one token each (outputs are cumulative)."""
    async def gen():
        text = ""
        for k, piece in enumerate(pieces):
            text += piece
            last = k == len(pieces) - 1
            yield RequestOutput("r", None, [1, 2], [CompletionOutput(0, text, list(range(k + 1)),
                                                                     "stop" if last else None)], last)
    return gen()


def test_a_thinking_models_stream_is_a_reasoning_item_then_a_message_and_is_stored_whole(bundled_tokenizer):
    st = SimpleNamespace(tokenizer=bundled_tokenizer, token_text=None)
    stored = []

    async def done(response):
        stored.append(response)

    async def collect():
        created = {"id": "resp_1", "object": "response", "status": "in_progress", "output": []}
        return [x async for x in response_events(ResponseEvents(), st, created, _scripted(THINKING_TOKENS),
                                                 Reply(reasoning=parser_for("qwen3")), None, {"prompt_tokens": 2},
                                                 0.0, done)]
    events = _events(asyncio.run(collect()))
    reasoning = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert (reasoning, text) == ("Two and two.\n", "It is 4.")
    (response,) = stored
    assert events[-1] == {"type": "response.completed", "response": response, "sequence_number": len(events) - 1}
    assert [x["type"] for x in response["output"]] == ["reasoning", "message"]
    assert response["output"][0]["content"] == [{"type": "reasoning_text", "text": reasoning}]
    assert response["usage"]["output_tokens"] == len(THINKING_TOKENS)
    assert response["usage"]["output_tokens_details"]["reasoning_tokens"] == len(
        bundled_tokenizer.encode(reasoning, add_special_tokens=False))


def test_reasoning_effort_is_the_templates_thinking_switch_and_needs_a_reasoning_parser():
    def req(**kw) -> ResponsesRequest:
        return ResponsesRequest.model_validate({"input": "hi", **kw})
    high = req(reasoning={"effort": "high"})
    assert high.unsupported(reasoning=False)[0] == "reasoning.effort" and high.unsupported(reasoning=True) is None
    items = input_items(high)
    assert to_chat_request(high, items).chat_template_kwargs == {"enable_thinking": True}
    off = req(reasoning={"effort": "none"})
    assert off.unsupported() is None and to_chat_request(off, items).chat_template_kwargs == {"enable_thinking": False}
    assert to_chat_request(req(), items).chat_template_kwargs is None
    assert req(reasoning={"effort": "low", "summary": "auto"}).unsupported(reasoning=True)[0] == "reasoning.summary"


def test_an_api_keys_service_classes_and_max_tokens_hold_on_the_responses_body():
    from tokenfab.server.keys import KeyPolicy
    from tokenfab.server.state import ServerState
    st = SimpleNamespace(config=SimpleNamespace(batch_priority=None))
    key = KeyPolicy("k", "batch-only", service_classes=("batch",), max_tokens=8)
    req = ResponsesRequest.model_validate({"input": "hi", "max_output_tokens": 9})
    with pytest.raises(APIError) as e:
        ServerState.check_key(st, key, req)            # what ServerState.parse runs on every body
    assert e.value.status == 403 and e.value.param == "service_tier"
    chat_req = to_chat_request(req, input_items(req))
    with pytest.raises(APIError) as e:
        ServerState.check_key(st, KeyPolicy("k", "short", max_tokens=8), chat_req)
    assert in_responses_terms(e.value).param == "max_output_tokens"

"""Structured output and tool calling over real HTTP on the bundled model, through the official `openai`
client and LangChain's `bind_tools`, streamed and not; bad schemas and tool choices are 400s."""
from __future__ import annotations

import json

import httpx
import jsonschema
import pytest
from openai import OpenAI

from tokenfab.server.app import build_app
from tokenfab.server.config import ServerConfig
from tokenfab.server.launch import ServerThread

pytestmark = pytest.mark.timeout(900)

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": -1000, "maximum": 1000},
                                        "b": {"type": "integer", "minimum": -1000, "maximum": 1000}},
       "required": ["a", "b"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "description": "Add two integers", "parameters": ADD}}]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
MODEL = "SmolLM2-135M-Instruct"
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def server(bundled_llm):
    app = build_app(bundled_llm.engine, ServerConfig(access_log=False))
    with ServerThread(app) as srv:
        yield srv
    assert bundled_llm.engine.block_manager.num_used_blocks() == 0


@pytest.fixture(scope="module")
def client(server) -> OpenAI:
    return OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=300) as c:
        yield c


def valid_calls(calls) -> list[tuple[str, dict]]:
    """(name, arguments) of each call, after checking the arguments against the function's schema."""
    out = []
    for c in calls:
        args = json.loads(c["function"]["arguments"] if isinstance(c, dict) else c.function.arguments)
        name = c["function"]["name"] if isinstance(c, dict) else c.function.name
        jsonschema.validate(args, SCHEMAS[name])
        out.append((name, args))
    return out


def collect_stream(stream) -> tuple[str, list[dict], str | None]:
    """(content, tool calls joined from their deltas, finish_reason) of a streamed chat completion."""
    content, calls, finish = "", {}, None
    for chunk in stream:
        if not chunk.choices:
            continue
        ch = chunk.choices[0]
        content += ch.delta.content or ""
        for d in ch.delta.tool_calls or []:
            c = calls.setdefault(d.index, {"id": None, "function": {"name": None, "arguments": ""}})
            if d.id:
                c["id"], c["function"]["name"] = d.id, d.function.name
            c["function"]["arguments"] += d.function.arguments or ""
        finish = ch.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


# -- structured output ---------------------------------------------------------------------------

def test_response_format_json_schema_validates_streamed_and_not(client):
    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    msgs = [{"role": "user", "content": "Describe a person as JSON."}]
    for seed in range(2):
        r = client.chat.completions.create(model=MODEL, messages=msgs, response_format=rf, max_tokens=80,
                                           temperature=1.0, seed=seed)
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)
    s = client.chat.completions.create(model=MODEL, messages=msgs, response_format=rf, max_tokens=80, temperature=0,
                                       stream=True)
    content, calls, finish = collect_stream(s)
    assert finish == "stop" and not calls
    jsonschema.validate(json.loads(content), PERSON)


def test_json_object_and_guided_extras_on_both_endpoints(client):
    r = client.chat.completions.create(model=MODEL, messages=ASK, response_format={"type": "json_object"},
                                       max_tokens=80, temperature=0)
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    r = client.completions.create(model=MODEL, prompt="Is water wet? Answer:", max_tokens=5, temperature=1.0, seed=1,
                                  extra_body={"guided_choice": ["yes", "no"]})
    assert r.choices[0].text in ("yes", "no")
    r = client.completions.create(model=MODEL, prompt="A person:", max_tokens=80, temperature=0,
                                  extra_body={"guided_json": PERSON})
    jsonschema.validate(json.loads(r.choices[0].text), PERSON)
    r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=20, temperature=1.0, seed=2,
                                       extra_body={"guided_regex": r"[A-Z][a-z]{2,8} is (sunny|rainy)\."})
    assert r.choices[0].message.content.split(" is ")[1] in ("sunny.", "rainy.")
    r = client.completions.create(model=MODEL, prompt="Digits:", max_tokens=20, temperature=1.0, seed=3,
                                  extra_body={"guided_grammar": 'root ::= [0-9] [0-9] [0-9]'})
    assert len(r.choices[0].text) == 3 and r.choices[0].text.isdigit()


# -- tool calling through the openai client ------------------------------------------------------

@pytest.mark.parametrize("parallel", [False, True])
def test_required_always_yields_valid_calls_streamed_and_not(client, parallel):
    # With parallel calls the model may keep calling until max_tokens: then the last call is cut off,
    # and every complete one must still be valid.
    for seed in range(2):
        r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=parallel, max_tokens=120, temperature=1.0, seed=seed)
        ch = r.choices[0]
        assert ch.message.tool_calls, ch
        assert ch.finish_reason == "tool_calls" if not parallel else ch.finish_reason in ("tool_calls", "length")
        assert len(ch.message.tool_calls) == 1 or parallel
        assert all(c.id.startswith("call_") and c.type == "function" for c in ch.message.tool_calls)
        valid_calls(ch.message.tool_calls)
        s = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=parallel, max_tokens=120, temperature=1.0, seed=seed,
                                           stream=True)
        content, calls, finish = collect_stream(s)
        assert calls and all(c["id"] for c in calls)
        names = [c.function.name for c in ch.message.tool_calls]       # same seed: the same calls
        assert [c["function"]["name"] for c in calls][:len(names)] == names[:len(calls)]
        if finish == "length":
            calls = calls[:-1]
        else:
            assert finish == "tool_calls" and not content.strip()
        valid_calls(calls)


def test_named_tool_choice_calls_exactly_that_function(client):
    choice = {"type": "function", "function": {"name": "add"}}
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "What is 2 plus 3?"}],
                                       tools=TOOLS, tool_choice=choice, max_tokens=60, temperature=0)
    assert [n for n, _ in valid_calls(r.choices[0].message.tool_calls)] == ["add"]


def test_a_conversation_with_tool_results_continues(client):
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                       parallel_tool_calls=False, max_tokens=80, temperature=0)
    msg = r.choices[0].message
    assert len(msg.tool_calls) == 1
    history = ASK + [msg.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": '{"temperature": 18, "sky": "sunny"}'}]
    final = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, max_tokens=40, temperature=0)
    assert final.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert final.choices[0].message.content or final.choices[0].message.tool_calls


def test_tool_choice_none_answers_in_text(client):
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=16,
                                       temperature=0)
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content


# -- LangChain -------------------------------------------------------------------------------------

def test_langchain_bind_tools_invoke_stream_and_tool_results(server):
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=server.url + "/v1", api_key="unused", model="SmolLM2-135M-Instruct",
                     temperature=0, max_tokens=100, max_retries=0, timeout=300)
    bound = llm.bind_tools(TOOLS, tool_choice="required")
    ai = bound.invoke([HumanMessage("What is the weather like in Paris today?")])
    assert ai.tool_calls and not ai.invalid_tool_calls
    for c in ai.tool_calls:
        jsonschema.validate(c["args"], SCHEMAS[c["name"]])
    merged = None
    for chunk in bound.stream([HumanMessage("What is the weather like in Paris today?")]):
        merged = chunk if merged is None else merged + chunk
    assert merged.tool_calls and [c["name"] for c in merged.tool_calls] == [c["name"] for c in ai.tool_calls]
    assert [c["args"] for c in merged.tool_calls] == [c["args"] for c in ai.tool_calls]
    history = [HumanMessage("What is the weather like in Paris today?"), ai] + [
        ToolMessage(content="18 C and sunny", tool_call_id=c["id"]) for c in ai.tool_calls]
    reply = llm.bind_tools(TOOLS).invoke(history)
    assert reply.content or reply.tool_calls


def test_langchain_with_structured_output_json_schema(server):
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=server.url + "/v1", api_key="unused", model="SmolLM2-135M-Instruct",
                     temperature=0, max_tokens=80, max_retries=0, timeout=300)
    schema = {"title": "person", "description": "A person", **PERSON}
    out = llm.with_structured_output(schema, method="json_schema").invoke("Describe a person.")
    jsonschema.validate(out, PERSON)


# -- bad input -------------------------------------------------------------------------------------

BAD = {
    "uncompilable response_format schema": (
        "/v1/chat/completions", {"messages": ASK, "response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "object", "required": ["n"],
                                    "properties": {"n": {"type": "integer", "minimum": 9, "maximum": 1}}}}}},
        "response_format", "unsatisfiable"),
    "response_format of unknown type": (
        "/v1/chat/completions", {"messages": ASK, "response_format": {"type": "yaml"}}, "response_format.type", "yaml"),
    "uncompilable guided_json on completions": (
        "/v1/completions", {"prompt": "hi", "guided_json": {"type": "frobnicate"}}, "guided_json", "frobnicate"),
    "broken guided_regex": ("/v1/completions", {"prompt": "hi", "guided_regex": "(["}, "guided_regex", "regex"),
    "two constraints at once": (
        "/v1/chat/completions", {"messages": ASK, "guided_regex": "a+", "response_format": {"type": "json_object"}},
        "guided_regex", "one"),
    "unknown tool_choice function": (
        "/v1/chat/completions", {"messages": ASK, "tools": TOOLS, "tool_choice": {"type": "function",
                                                                                  "function": {"name": "launch"}}},
        "tool_choice.function.name", "launch"),
    "tool_choice without tools": (
        "/v1/chat/completions", {"messages": ASK, "tool_choice": "required"}, "tool_choice", "tools"),
    "tool with an invalid parameter schema": (
        "/v1/chat/completions", {"messages": ASK, "tools": [{"type": "function", "function": {
            "name": "f", "parameters": {"type": "object", "properties": {"x": {"$ref": "#/$defs/missing"}}}}}]},
        "tools[0].function.parameters", "missing"),
    "response_format with a forced tool call": (
        "/v1/chat/completions", {"messages": ASK, "tools": TOOLS, "tool_choice": "required",
                                 "response_format": {"type": "json_object"}}, "response_format", "tool_choice"),
    "malformed tool_calls in history": (
        "/v1/chat/completions", {"messages": ASK + [{"role": "assistant", "tool_calls": [{"type": "function"}]}]},
        "messages[1].tool_calls[0]", "tool_calls"),
}
CODES = {"malformed tool_calls in history": "invalid_tool_calls"}     # the rest: invalid_value


@pytest.mark.parametrize("case", list(BAD))
def test_bad_structured_or_tool_input_is_400_with_code_and_field(http, case):
    path, body, param, word = BAD[case]
    r = http.post(path, json={"max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and word in err["message"], err
    assert err["code"] == CODES.get(case, "invalid_value"), err
    assert http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1}).status_code == 200

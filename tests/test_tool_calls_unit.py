"""Tool calling without a model: the Hermes parser (whole and streamed), the forced-call grammar, and
how tools and earlier tool turns reach the chat template."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from tokenfab.server.errors import APIError
from tokenfab.server.tool_parsers import HermesToolParser
from tokenfab.server.config import ServerConfig
from tokenfab.server.tool_parsers import PARSERS, parser_for
from tokenfab.server.tools import InvalidToolCalls, plan_tools, template_input

TEXT = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa}ris", "opts": {"n": [1, 2]}}}'
        '\n</tool_call>\n<tool_call>\n{"name": "add", "arguments": {}}\n</tool_call>\n')
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
             "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
         {"type": "function", "function": {"name": "add", "parameters": {
             "type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}, "required": ["a", "b"]}}}]


def streamed(text: str, step: int) -> tuple[str, dict[int, dict]]:
    """Feed `text` in pieces of `step` chars; returns (content, {index: {id, name, arguments}})."""
    s = HermesToolParser().streamer()
    content, calls = "", {}
    pieces = [text[i:i + step] for i in range(0, len(text), step)]
    for k, piece in enumerate(pieces):
        c, deltas = s.feed(piece)
        if k == len(pieces) - 1:
            c2, d2 = s.finish()
            c, deltas = c + c2, deltas + d2
        content += c
        for d in deltas:
            call = calls.setdefault(d["index"], {"id": None, "name": None, "arguments": ""})
            if "id" in d:
                assert call["id"] is None, "a call's first delta came twice"
                call.update(id=d["id"], name=d["function"]["name"])
            else:
                assert call["id"] is not None, "arguments arrived before the call's first delta"
            call["arguments"] += d["function"].get("arguments", "")
    return content, calls


def test_parse_finds_every_call_and_keeps_the_text_around_them():
    content, calls = HermesToolParser().parse(TEXT)
    assert content == "Let me check."
    assert [c.name for c in calls] == ["get_weather", "add"]
    assert json.loads(calls[0].arguments) == {"city": "Pa}ris", "opts": {"n": [1, 2]}}
    assert json.loads(calls[1].arguments) == {} and calls[0].id != calls[1].id


def test_text_that_is_not_a_valid_call_stays_content():
    text = "Use <tool_call>{not json}</tool_call> carefully"
    assert HermesToolParser().parse(text) == (text, [])
    assert HermesToolParser().parse("plain answer") == ("plain answer", [])


@pytest.mark.parametrize("step", [1, 2, 5, 13, 1000])
def test_streamed_deltas_join_to_the_same_calls_at_any_chunking(step):
    content, calls = streamed(TEXT, step)
    assert content == "Let me check.\n"
    assert [c["name"] for c in calls.values()] == ["get_weather", "add"]
    assert json.loads(calls[0]["arguments"]) == {"city": "Pa}ris", "opts": {"n": [1, 2]}}
    assert json.loads(calls[1]["arguments"]) == {}


def test_a_call_cut_off_by_max_tokens_still_streams_what_it_had():
    content, calls = streamed('<tool_call>\n{"name": "add", "arguments": {"a": 1, "b"', 3)
    assert content == "" and calls[0]["name"] == "add" and calls[0]["arguments"].startswith('{"a": 1')


def req(**kw):
    base = dict(tools=TOOLS, tool_choice=None, parallel_tool_calls=True)
    return SimpleNamespace(**{**base, **kw})


def test_tool_choice_is_resolved_and_validated():
    assert plan_tools(req()).choice == "auto"
    assert plan_tools(req(tool_choice="required")).structure() is not None
    named = plan_tools(req(tool_choice={"type": "function", "function": {"name": "add"}}))
    assert named.choice == "named" and '"add"' in named.structure().grammar and "get_weather" not in named.structure().grammar
    assert plan_tools(req(tool_choice="auto")).structure() is None
    assert plan_tools(req(tools=None)) is None


@pytest.mark.parametrize("kw, param", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name"),
    ({"tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": None, "tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0]"),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "tools[1].function.name"),
])
def test_bad_tools_or_tool_choice_are_400_naming_the_field(kw, param):
    with pytest.raises(APIError) as e:
        plan_tools(req(**kw))
    assert (e.value.status, e.value.param, e.value.code) == (400, param, "invalid_value")


def test_tools_and_tool_turns_reach_a_template_without_a_tool_format_as_hermes_text(bundled_tokenizer):
    msgs = [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"}]
    out, kw = template_input(bundled_tokenizer, msgs, plan_tools(req()))
    assert kw == {} and out[0]["role"] == "system" and '"name": "get_weather"' in out[0]["content"]
    prompt = bundled_tokenizer.apply_chat_template(out, tokenize=False, add_generation_prompt=True)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in prompt
    assert "<tool_response>\n18 C, sunny\n</tool_response>" in prompt
    assert "<tools>" in prompt


def test_a_tool_aware_template_gets_tools_and_tool_calls_natively(bundled_tokenizer):
    import copy
    tok = copy.deepcopy(bundled_tokenizer)
    tok.chat_template = ("{% for t in tools or [] %}TOOL {{ t.function.name }}\n{% endfor %}"
                         "{% for m in messages %}{{ m.role }}: {{ m.content }}"
                         "{% for c in m.tool_calls or [] %} CALL {{ c.function.name }}({{ c.function.arguments.city }})"
                         "{% endfor %}\n{% endfor %}")
    msgs = [{"role": "user", "content": "hi"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]}]
    out, kw = template_input(tok, msgs, plan_tools(req()))
    text = tok.apply_chat_template(out, tokenize=False, **kw)
    assert "TOOL get_weather\nTOOL add\n" in text and "CALL get_weather(Oslo)" in text


@pytest.mark.parametrize("call", [{"type": "function"}, "get_weather()", {"function": {"arguments": "{}"}}])
def test_malformed_tool_calls_in_history_name_the_message_and_call(bundled_tokenizer, call):
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": [call]}]
    with pytest.raises(InvalidToolCalls) as e:
        template_input(bundled_tokenizer, msgs, None)
    assert e.value.param == "messages[1].tool_calls[0]" and "messages[1]" in str(e.value)


def test_template_failures_and_bad_tool_calls_are_400s_with_their_own_codes(bundled_tokenizer):
    import copy

    from tokenfab.server.chat import conversation_ids
    from tokenfab.server.protocol import ChatMessage
    tok = copy.deepcopy(bundled_tokenizer)
    tok.chat_template = "{{ raise_exception('this template takes no system messages') }}"
    st = SimpleNamespace(tokenizer=tok, config=ServerConfig())
    with pytest.raises(APIError) as e:
        conversation_ids(st, [ChatMessage(role="system", content="be brief")])
    assert (e.value.status, e.value.code, e.value.param) == (400, "chat_template_error", "messages")
    assert "no system messages" in e.value.message
    tok.chat_template = "{% for m in messages %}{% endfor %}"
    with pytest.raises(APIError) as e:
        conversation_ids(st, [ChatMessage(role="user", content="hi")])
    assert (e.value.code, e.value.param) == ("chat_template_error", "messages") and "empty" in e.value.message
    st.tokenizer = bundled_tokenizer
    bad = ChatMessage(role="assistant", content="", tool_calls=[{"type": "function"}])
    with pytest.raises(APIError) as e:
        conversation_ids(st, [ChatMessage(role="user", content="hi"), bad])
    assert (e.value.code, e.value.param) == ("invalid_tool_calls", "messages[1].tool_calls[0]")


def test_tool_call_parser_is_chosen_by_name_and_unknown_names_are_refused():
    assert isinstance(parser_for(None, "hermes"), PARSERS["hermes"])
    assert isinstance(plan_tools(req(), "hermes").parser, PARSERS["hermes"])
    with pytest.raises(ValueError, match="unknown tool-call parser 'mistral'; known: hermes"):
        ServerConfig(tool_call_parser="mistral").validate()
    ServerConfig(tool_call_parser="hermes").validate()

"""Reasoning parsers without a model: `<think>` split at every position across streamed pieces, with and
without a tool call in the answer, replies without tags, an unterminated `<think>`, DeepSeek-R1's output
that starts inside its reasoning; and the output path that turns scripted engine outputs into chat
chunks and Anthropic events (chat.chunks, messages_reply.message_events), as a thinking model's would be."""
from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from tokenfab.outputs import CompletionOutput, RequestOutput
from tokenfab.server.chat import chunks, conversation_ids
from tokenfab.server.config import ServerConfig
from tokenfab.server.errors import APIError
from tokenfab.server.messages import to_chat_request
from tokenfab.server.messages_protocol import MessagesRequest
from tokenfab.server.messages_reply import content_blocks, message_events
from tokenfab.server.protocol import ChatCompletionRequest, ChatMessage
from tokenfab.server.reasoning import PARSERS, parser_for
from tokenfab.server.reply import Reply
from tokenfab.server.tools import plan_tools

THOUGHT = "<think>\nThe user wants 2+2. That is 4.\n</think>\n\nThe sum is 4."
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 2}}\n</tool_call>'
WITH_CALL = f"<think>\nI could write {CALL} but first check.\n</think>\n\nLet me add.\n{CALL}"
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}}}}]


def tool_plan():
    return plan_tools(SimpleNamespace(tools=TOOLS, tool_choice=None, parallel_tool_calls=True))


def streamed(reply: Reply, pieces: list[str]) -> dict:
    """Feed `pieces` through a reply stream (the last with finish "stop"): the joined reasoning, content,
    tool calls and the finish reason; every delta body but the last carries something."""
    s = reply.stream()
    out = {"reasoning": "", "content": "", "calls": {}, "finish": None}
    for k, piece in enumerate(pieces):
        last = k == len(pieces) - 1
        body, finish = s.feed(piece, "stop" if last else None)
        assert all(body.values()), f"an empty field in {body}"
        out["reasoning"] += body.get("reasoning_content", "")
        out["content"] += body.get("content", "")
        for d in body.get("tool_calls", ()):
            call = out["calls"].setdefault(d["index"], {"name": None, "arguments": ""})
            call["name"] = call["name"] or d["function"].get("name")
            call["arguments"] += d["function"].get("arguments", "")
        if last:
            out["finish"] = finish
    return out


def every_split(text: str):
    """`text` cut into two pieces at every position, and into one-character pieces."""
    for i in range(len(text) + 1):
        yield [text[:i], text[i:]]
    yield list(text)


def test_reasoning_and_answer_are_split_at_the_tags():
    reasoning, answer = parser_for("qwen3").split(THOUGHT)
    assert reasoning == "The user wants 2+2. That is 4.\n" and answer == "The sum is 4."


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_a_tag_split_at_any_position_streams_the_same_reasoning_and_answer(name):
    reply = Reply(reasoning=parser_for(name))
    for pieces in every_split(THOUGHT):
        got = streamed(reply, pieces)
        assert (got["reasoning"], got["content"]) == ("The user wants 2+2. That is 4.\n", "The sum is 4."), pieces


def test_split_into_three_pieces_at_every_pair_of_positions():
    reply = Reply(reasoning=parser_for("qwen3"))
    text = "<think>ab</think>cd"
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1):
            got = streamed(reply, [text[:i], text[i:j], text[j:]])
            assert (got["reasoning"], got["content"]) == ("ab", "cd"), (i, j)


def test_only_a_possible_tag_prefix_is_held_back():
    s = parser_for("qwen3").streamer()
    assert s.feed("<thi") == ("", "")                      # could still be <think>
    assert s.feed("nk>Let me see </th") == ("Let me see ", "")
    assert s.feed("is is fine") == ("</this is fine", "")  # was not </think> after all: sent at once
    assert s.feed("</think>4") == ("", "4")


@pytest.mark.parametrize("pieces", list(every_split(WITH_CALL)), ids=lambda p: str(len(p[0])) if len(p) == 2 else "chars")
def test_tool_calls_are_parsed_from_the_answer_only(pieces):
    got = streamed(Reply(tool_plan(), parser_for("qwen3")), pieces)
    assert got["reasoning"] == f"I could write {CALL} but first check.\n"
    assert got["content"] == "Let me add.\n"
    assert [c["name"] for c in got["calls"].values()] == ["add"]
    assert json.loads(got["calls"][0]["arguments"]) == {"a": 2, "b": 2}
    assert got["finish"] == "tool_calls"


def test_whole_reply_with_a_call_has_reasoning_content_and_tool_calls():
    message, finish = Reply(tool_plan(), parser_for("qwen3")).message(WITH_CALL, "stop")
    assert message["reasoning_content"] == f"I could write {CALL} but first check.\n"
    assert message["content"] == "Let me add."
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["add"] and finish == "tool_calls"


@pytest.mark.parametrize("name, reasoning, content", [("qwen3", None, "Hello <b>there</b>"),
                                                      ("deepseek_r1", "Hello <b>there</b>", None)])
def test_a_reply_without_tags(name, reasoning, content):
    """Qwen3: all answer; R1: all reasoning (its output starts inside the reasoning), as vLLM's parsers."""
    message, _ = Reply(reasoning=parser_for(name)).message("Hello <b>there</b>", "stop")
    assert (message["reasoning_content"], message["content"]) == (reasoning, content)
    for pieces in every_split("Hello <b>there</b>"):
        got = streamed(Reply(reasoning=parser_for(name)), pieces)
        assert (got["reasoning"] or None, got["content"] or None) == (reasoning, content)


def test_an_unterminated_think_is_all_reasoning_whole_and_streamed():
    text = "<think>\nStill thinking when max_tokens c"
    assert parser_for("qwen3").split(text) == ("Still thinking when max_tokens c", "")
    message, finish = Reply(reasoning=parser_for("qwen3")).message(text, "length")
    assert (message["reasoning_content"], message["content"], finish) == ("Still thinking when max_tokens c", None,
                                                                          "length")
    for pieces in every_split(text):
        assert streamed(Reply(reasoning=parser_for("qwen3")), pieces)["reasoning"] == "Still thinking when max_tokens c"


def test_r1_output_without_its_opening_tag_starts_inside_the_reasoning():
    text = "Okay, 2+2 is 4.\n</think>\n\n**4**"
    assert parser_for("deepseek_r1").split(text) == ("Okay, 2+2 is 4.\n", "**4**")
    assert parser_for("deepseek_r1").split("<think>" + text) == ("Okay, 2+2 is 4.\n", "**4**")
    assert parser_for("qwen3").split(text) == (None, text)       # qwen3 needs the opening tag...
    qwen3 = parser_for("qwen3")
    inside = qwen3.starts_inside("<|im_start|>assistant\n<think>\n")
    assert inside and qwen3.split(text, inside) == ("Okay, 2+2 is 4.\n", "**4**")   # ...unless the prompt opened it
    assert not qwen3.starts_inside("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    for pieces in every_split(text):
        got = streamed(Reply(reasoning=parser_for("deepseek_r1")), pieces)
        assert (got["reasoning"], got["content"]) == ("Okay, 2+2 is 4.\n", "**4**"), pieces


def test_a_think_tag_inside_the_answer_is_answer_text():
    assert parser_for("qwen3").split("Use <think> tags like <think>this</think>.") == (
        None, "Use <think> tags like <think>this</think>.")


def test_unknown_parser_names_list_the_known_ones():
    with pytest.raises(ValueError, match="unknown reasoning parser 'r2'; known: deepseek_r1, qwen3"):
        ServerConfig(reasoning_parser="r2").validate()
    ServerConfig(reasoning_parser="deepseek_r1").validate()
    assert parser_for(None) is None


# -- the output path, with scripted engine outputs -----------------------------------------------
def scripted(pieces: list[str], finish: str = "stop"):
    """An engine stream whose one choice writes `pieces`, one token each (outputs are cumulative)."""
    async def gen():
        text = ""
        for k, piece in enumerate(pieces):
            text += piece
            last = k == len(pieces) - 1
            o = CompletionOutput(0, text, list(range(k + 1)), finish if last else None)
            yield RequestOutput("r", None, [1, 2], [o], last)
    return gen()


def run(agen) -> list[str]:
    async def collect():
        return [x async for x in agen]
    return asyncio.run(collect())


THINKING_TOKENS = ["<th", "ink", ">\n", "Two ", "and two", ".\n</", "think", ">\n\n", "It is ", "4."]


def chat_chunks(pieces: list[str], reply: Reply, **req) -> list[dict]:
    st = SimpleNamespace(model_name="m", token_text=None)
    r = ChatCompletionRequest(messages=[ChatMessage(role="user", content="2+2?")], stream=True, **req)
    out = run(chunks(st, r, "chatcmpl-1", scripted(pieces), None, 1,
                     {"prompt_tokens": 2}, 0.0, reply))
    return [json.loads(c.removeprefix("data: ")) for c in out]


def test_streamed_chat_chunks_carry_reasoning_content_then_content():
    bodies = chat_chunks(THINKING_TOKENS, Reply(reasoning=parser_for("qwen3")))
    assert bodies[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    deltas = [b["choices"][0]["delta"] for b in bodies[1:]]
    assert all(deltas[:-1]), "a chunk with nothing in it"
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "Two and two.\n"
    assert "".join(d.get("content", "") for d in deltas) == "It is 4."
    first_content = next(i for i, d in enumerate(deltas) if "content" in d)
    assert not any("reasoning_content" in d for d in deltas[first_content:])
    assert bodies[-1]["choices"][0]["finish_reason"] == "stop"


def test_held_back_tokens_keep_their_logprobs_for_the_next_chunk():
    from tokenfab.outputs import Logprob

    async def gen():
        text = ""
        for k, piece in enumerate(THINKING_TOKENS):
            text += piece
            lps = [{t: Logprob(-0.5)} for t in range(k + 1)]
            o = CompletionOutput(0, text, list(range(k + 1)), "stop" if k == len(THINKING_TOKENS) - 1 else None,
                                 logprobs=lps)
            yield RequestOutput("r", None, [1, 2], [o], False)
    st = SimpleNamespace(model_name="m", token_text=SimpleNamespace(get=lambda t: (str(t), b"")))
    r = ChatCompletionRequest(messages=[ChatMessage(role="user", content="2+2?")], stream=True, logprobs=True)
    out = run(chunks(st, r, "c", gen(), 0, 1, {"prompt_tokens": 2}, 0.0, Reply(reasoning=parser_for("qwen3"))))
    bodies = [json.loads(c.removeprefix("data: ")) for c in out][1:]
    tokens = [e["token"] for b in bodies for e in b["choices"][0]["logprobs"]["content"]]
    assert tokens == [str(i) for i in range(len(THINKING_TOKENS))]


def test_streamed_messages_events_open_a_thinking_block_before_the_text():
    events = run(message_events("msg_1", "m", scripted(THINKING_TOKENS), Reply(reasoning=parser_for("qwen3")),
                                None, {"prompt_tokens": 2}, 0.0))
    parsed = [(e.split("\n")[0].removeprefix("event: "), json.loads(e.split("\n")[1].removeprefix("data: ")))
              for e in events]
    names = [n for n, _ in parsed]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    starts = [d["content_block"] for n, d in parsed if n == "content_block_start"]
    assert starts == [{"type": "thinking", "thinking": "", "signature": ""}, {"type": "text", "text": ""}]
    thinking = "".join(d["delta"]["thinking"] for n, d in parsed
                       if n == "content_block_delta" and d["delta"]["type"] == "thinking_delta")
    text = "".join(d["delta"]["text"] for n, d in parsed
                   if n == "content_block_delta" and d["delta"]["type"] == "text_delta")
    assert (thinking, text) == ("Two and two.\n", "It is 4.")
    assert [d["index"] for n, d in parsed if n == "content_block_stop"] == [0, 1]


def test_whole_messages_reply_has_a_thinking_block_before_text_and_tool_use():
    blocks, finish = content_blocks(Reply(tool_plan(), parser_for("qwen3")), WITH_CALL, "stop")
    assert [b["type"] for b in blocks] == ["thinking", "text", "tool_use"] and finish == "tool_calls"
    assert blocks[0] == {"type": "thinking", "thinking": f"I could write {CALL} but first check.\n", "signature": ""}
    assert blocks[2]["input"] == {"a": 2, "b": 2}


# -- the thinking switch -------------------------------------------------------------------------
def messages_request(**kw) -> MessagesRequest:
    return MessagesRequest.model_validate({"model": "m", "max_tokens": 8,
                                           "messages": [{"role": "user", "content": "hi"}], **kw})


def test_messages_thinking_maps_to_the_templates_switch_and_needs_a_reasoning_parser():
    enabled = messages_request(thinking={"type": "enabled", "budget_tokens": 1024})
    assert enabled.unsupported(reasoning=False)[0] == "thinking"
    assert "--reasoning-parser" in enabled.unsupported(reasoning=False)[1]
    assert enabled.unsupported(reasoning=True) is None
    assert to_chat_request(enabled).chat_template_kwargs == {"enable_thinking": True}
    disabled = messages_request(thinking={"type": "disabled"})
    assert disabled.unsupported() is None
    assert to_chat_request(disabled).chat_template_kwargs == {"enable_thinking": False}
    assert to_chat_request(messages_request()).chat_template_kwargs is None
    assert messages_request(thinking={"type": "sometimes"}).unsupported(reasoning=True)[0] == "thinking"


def test_thinking_blocks_sent_back_in_assistant_turns_are_left_out_of_the_prompt():
    req = messages_request(messages=[
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "greet back", "signature": ""},
                                          {"type": "text", "text": "Hello!"}]},
        {"role": "user", "content": "bye"}])
    assert [m.model_dump(exclude_none=True) for m in to_chat_request(req).messages][1] == {
        "role": "assistant", "content": "Hello!"}


SWITCH = ("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
          "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}")


def test_chat_template_kwargs_reach_the_template_and_unknown_ones_are_ignored(bundled_tokenizer):
    import copy
    st = SimpleNamespace(tokenizer=bundled_tokenizer, config=ServerConfig())
    hi = [ChatMessage(role="user", content="hi")]
    plain = conversation_ids(st, hi)
    assert conversation_ids(st, hi, template_kwargs={"enable_thinking": False, "no_such_variable": 1}) == plain
    st.tokenizer = copy.deepcopy(bundled_tokenizer)
    st.tokenizer.chat_template = SWITCH
    off = bundled_tokenizer.decode(conversation_ids(st, hi, template_kwargs={"enable_thinking": False}))
    on = bundled_tokenizer.decode(conversation_ids(st, hi, template_kwargs={"enable_thinking": True}))
    assert off.endswith("<think>\n\n</think>\n\n") and "<think>" not in on
    with pytest.raises(APIError) as e:
        conversation_ids(st, hi, template_kwargs={"tokenize": False})
    assert (e.value.status, e.value.param) == (400, "chat_template_kwargs.tokenize")


def test_a_constrained_reply_is_all_answer_so_the_parser_is_off_for_it(bundled_tokenizer):
    """A grammar constrains the output from its first token, so there is no reasoning to split off;
    R1's parser would otherwise take a JSON answer for reasoning."""
    from tokenfab.server.chat import reply_plan
    from tokenfab.structured_output import StructuredOutputParams
    st = SimpleNamespace(tokenizer=bundled_tokenizer, config=ServerConfig(reasoning_parser="deepseek_r1"))
    ids = bundled_tokenizer.encode("hi")
    assert reply_plan(st, None, StructuredOutputParams(json_object=True), ids).reasoning is None
    free = reply_plan(st, None, None, ids)
    assert free.reasoning is not None and free.inside
    assert free.message('{"a": 1}', "stop")[0]["content"] is None      # why it must be off

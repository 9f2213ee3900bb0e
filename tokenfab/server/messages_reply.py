"""The reply of /v1/messages in Anthropic's shape, whole or streamed: content blocks, stop_reason, usage.

The model's text goes through the request's reasoning and tool-call parsers (server/reply.py), as in
chat completions; what they give, reasoning, content and calls, becomes thinking, text and tool_use
blocks here (a thinking block's `signature` is empty: tokenfab signs nothing). Streamed, the events
are Anthropic's, each with its `event:` line:

    message_start -> (content_block_start -> content_block_delta* -> content_block_stop)*
                  -> message_delta (stop_reason, usage) -> message_stop

Reasoning arrives as `thinking_delta`s, text as `text_delta`s; a tool call as a tool_use block whose `input_json_delta` fragments join
to its input's JSON text. A block opens only when it has something to say, so a reply that is one
tool call has no empty text block before it, and the streamed text equals the whole reply's text.
"""
from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator

from tokenfab.server.errors import anthropic_error_body
from tokenfab.server.streaming import ChoiceDelta
from tokenfab.server.reply import Reply


def event(name: str, data: dict) -> str:
    return f"event: {name}\ndata: {json.dumps(data, separators=(',', ':'), ensure_ascii=False)}\n\n"


def anthropic_error_event(message: str) -> str:
    """An engine failure in the middle of a stream, as Anthropic sends errors there."""
    return event("error", anthropic_error_body(500, message))


def tool_use_id(call_id: str) -> str:
    """Anthropic's id style for the parser's call ids (call_<hex> -> toolu_<hex>)."""
    return "toolu_" + call_id.removeprefix("call_")


def content_blocks(reply: Reply, text: str, finish_reason: str | None) -> tuple[list[dict], str | None]:
    """(the reply's content blocks, the chat finish reason) from the model's whole text."""
    message, finish_reason = reply.message(text, finish_reason)
    blocks = [{"type": "thinking", "thinking": message["reasoning_content"], "signature": ""}] \
        if message.get("reasoning_content") else []
    if message.get("content"):
        blocks.append({"type": "text", "text": message["content"]})
    for c in message.get("tool_calls") or ():
        fn = c["function"]
        try:
            args = json.loads(fn["arguments"])
        except ValueError:
            args = None
        if isinstance(args, dict):
            blocks.append({"type": "tool_use", "id": tool_use_id(c["id"]), "name": fn["name"], "input": args})
        else:           # arguments that are not an object cannot be a tool_use input: the text the model wrote
            blocks.append({"type": "text", "text": reply.tools.parser.format_call(fn["name"], fn["arguments"])})
    return blocks, finish_reason


def stop_reason(finish_reason: str | None, stopped_by: int | str | None,
                stop_sequences: list[str] | None) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) for a chat finish reason and what stopped the engine."""
    if finish_reason == "tool_calls":
        return "tool_use", None
    if finish_reason == "length":
        return "max_tokens", None
    if isinstance(stopped_by, str) and stopped_by in (stop_sequences or ()):
        return "stop_sequence", stopped_by
    return "end_turn", None


async def message_events(rid: str, model: str, stream, reply: Reply, stop_sequences: list[str] | None,
                         access: dict, arrival: float) -> AsyncIterator[str]:
    """The reply to a streamed /v1/messages request, event by event, from its engine stream."""
    prompt_tokens = access["prompt_tokens"]
    yield event("message_start", {"type": "message_start", "message": {
        "id": rid, "type": "message", "role": "assistant", "model": model, "content": [], "stop_reason": None,
        "stop_sequence": None, "usage": {"input_tokens": prompt_tokens, "output_tokens": 0}}})
    delta = ChoiceDelta()
    parts = reply.stream()
    blocks = _Blocks()
    finish: tuple[str | None, int | str | None] = (None, None)
    async for out in stream:
        (o,) = out.outputs
        d = delta.advance(o)
        if d is None:
            continue
        body, finish_reason = parts.feed(d.text, d.finish_reason)
        if access.get("ttft_s") is None and body:
            access["ttft_s"] = time.monotonic() - arrival
        access["output_tokens"] = delta.token_count
        for e in blocks.feed(body):
            yield e
        if finish_reason is not None:
            finish = (finish_reason, d.stop_reason)
    for e in blocks.close():
        yield e
    reason, sequence = stop_reason(*finish, stop_sequences)
    yield event("message_delta", {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
                                  "usage": {"input_tokens": prompt_tokens, "output_tokens": delta.token_count}})
    yield event("message_stop", {"type": "message_stop"})


class _Blocks:
    """Chat-style deltas ({"reasoning_content", "content", "tool_calls"}) -> content block events, one
    block open at a time."""

    def __init__(self) -> None:
        self.index = -1
        self.open: str | None = None        # the open block's type

    def feed(self, body: dict) -> list[str]:
        out = []
        if body.get("reasoning_content"):
            if self.open != "thinking":
                out += self._start({"type": "thinking", "thinking": "", "signature": ""})
            out.append(self._delta({"type": "thinking_delta", "thinking": body["reasoning_content"]}))
        if body.get("content"):
            if self.open != "text":
                out += self._start({"type": "text", "text": ""})
            out.append(self._delta({"type": "text_delta", "text": body["content"]}))
        for c in body.get("tool_calls") or ():
            if "id" in c:                   # a call's first delta: a new tool_use block
                out += self._start({"type": "tool_use", "id": tool_use_id(c["id"]), "name": c["function"]["name"],
                                    "input": {}})
            if c["function"].get("arguments"):
                out.append(self._delta({"type": "input_json_delta", "partial_json": c["function"]["arguments"]}))
        return out

    def close(self) -> list[str]:
        if self.open is None:
            return []
        self.open = None
        return [event("content_block_stop", {"type": "content_block_stop", "index": self.index})]

    def _start(self, block: dict) -> list[str]:
        out = self.close()
        self.index += 1
        self.open = block["type"]
        return out + [event("content_block_start", {"type": "content_block_start", "index": self.index,
                                                    "content_block": block})]

    def _delta(self, delta: dict) -> str:
        return event("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta})

"""The reply of /v1/responses in the Responses API's shape, whole or streamed: output items, status, usage.

The model's text goes through the request's reasoning and tool-call parsers (server/reply.py), as in
chat completions; what they give, reasoning, content and calls, becomes output items here: a
`reasoning` item (its text as a `reasoning_text` content part; no summary), a `message` with one
`output_text` part, and a `function_call` item per call. A reply that is only calls has no message;
any other reply has one, empty text included. Streamed, the events are the API's typed events, each
with its `event:` line and a `sequence_number` counting from 0:

    response.created -> response.in_progress
      -> per item: response.output_item.added
           message:   content_part.added -> output_text.delta* -> output_text.done -> content_part.done
           reasoning: content_part.added -> reasoning_text.delta* -> reasoning_text.done -> content_part.done
           call:      function_call_arguments.delta* -> function_call_arguments.done
         -> response.output_item.done
      -> response.completed (response.incomplete when max_output_tokens cut it off)

The last event carries the whole response, the same object the non-streamed request returns and GET
/v1/responses/{id} gives back. Logprobs (include message.output_text.logprobs) are those of every
token the model wrote, in chat's format, on the message's output_text part.
"""
from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from tokenfab.server.logprobs import chat_logprobs
from tokenfab.server.reply import Reply
from tokenfab.server.responses_input import new_id
from tokenfab.server.streaming import ChoiceDelta


def usage(prompt_tokens: int, output_tokens: int, cached_tokens: int, reasoning_tokens: int) -> dict:
    return {"input_tokens": prompt_tokens,
            "input_tokens_details": {"cached_tokens": cached_tokens, "cache_write_tokens": 0},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": prompt_tokens + output_tokens}


def status_of(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


def finished(obj: dict, output: list[dict], finish_reason: str | None, usage_: dict) -> dict:
    """The response object `obj` (as created) once its output is complete."""
    status = status_of(finish_reason)
    return {**obj, "status": status, "output": output, "usage": usage_,
            "completed_at": int(time.time()) if status == "completed" else None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None}


def output_items(message: dict, finish_reason: str | None, logprobs: list[dict]) -> list[dict]:
    """The output items of a whole reply, from chat's assistant message (Reply.message)."""
    items = []
    if message.get("reasoning_content"):
        items.append(_reasoning_item(message["reasoning_content"]))
    calls = message.get("tool_calls") or []
    if message.get("content") or not calls:
        items.append(_message_item(message.get("content") or "", logprobs, status_of(finish_reason)))
    items += [_call_item(c["id"], c["function"]["name"], c["function"]["arguments"]) for c in calls]
    return items


def _reasoning_item(text: str, item_id: str | None = None, status: str = "completed") -> dict:
    return {"id": item_id or new_id("rs"), "type": "reasoning", "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "status": status}


def _text_part(text: str, logprobs: list[dict]) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}


def _message_item(text: str, logprobs: list[dict], status: str, item_id: str | None = None) -> dict:
    return {"id": item_id or new_id("msg"), "type": "message", "role": "assistant", "status": status,
            "content": [_text_part(text, logprobs)]}


def _call_item(call_id: str, name: str, arguments: str, item_id: str | None = None, status: str = "completed") -> dict:
    return {"id": item_id or new_id("fc"), "type": "function_call", "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


def reasoning_text(items: list[dict]) -> str:
    return "".join(p["text"] for x in items if x["type"] == "reasoning" for p in x["content"])


class ResponseEvents:
    """Chat-style deltas ({"reasoning_content", "content", "tool_calls"}) -> the typed events, one output
    item open at a time; `items` holds the output as it is built."""

    def __init__(self) -> None:
        self.seq = 0
        self.items: list[dict] = []
        self.open: dict | None = None       # the open item, its text or arguments accumulating
        self.logprobs: list[dict] = []      # every token's, for the message's part

    def event(self, kind: str, **fields) -> str:
        data = {"type": kind, **fields, "sequence_number": self.seq}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(data, separators=(',', ':'), ensure_ascii=False)}\n\n"

    def error(self, message: str) -> str:
        """An engine failure in the middle of the stream."""
        return self.event("error", code="engine_error", message=message, param=None)

    def feed(self, body: dict, logprobs: list[dict]) -> list[str]:
        out = []
        self.logprobs += logprobs
        if body.get("reasoning_content"):
            if self._kind() != "reasoning":
                out += self._add(_reasoning_item("", status="in_progress"))
            out += self._text_delta("response.reasoning_text.delta", body["reasoning_content"], [])
        if body.get("content"):
            if self._kind() != "message":
                out += self._add(_message_item("", [], "in_progress"))
            out += self._text_delta("response.output_text.delta", body["content"], logprobs)
        for c in body.get("tool_calls") or ():
            if "id" in c:                   # a call's first delta: a new function_call item
                out += self._add(_call_item(c["id"], c["function"]["name"], "", status="in_progress"))
            if c["function"].get("arguments"):
                self.open["arguments"] += c["function"]["arguments"]
                out.append(self.event("response.function_call_arguments.delta", item_id=self.open["id"],
                                      output_index=len(self.items) - 1, delta=c["function"]["arguments"]))
        return out

    def close(self, status: str = "completed") -> list[str]:
        """Close the open item; at the end (`status` the response's), a reply with neither text nor calls
        gets its empty message first."""
        out = []
        if status != "open" and not any(x["type"] in ("message", "function_call") for x in self.items):
            out += self._add(_message_item("", [], "in_progress"))
        x, self.open = self.open, None
        if x is None:
            return out
        index, ref = len(self.items) - 1, {"item_id": x["id"], "output_index": len(self.items) - 1}
        if x["type"] == "function_call":
            x["status"] = "completed"
            out.append(self.event("response.function_call_arguments.done", **ref, name=x["name"],
                                  arguments=x["arguments"]))
        else:
            part = x["content"][0]
            if x["type"] == "message":
                x["status"] = status if status != "open" else "completed"
                part["logprobs"] = self.logprobs
                out.append(self.event("response.output_text.done", **ref, content_index=0, text=part["text"],
                                      logprobs=part["logprobs"]))
            else:
                x["status"] = "completed"
                out.append(self.event("response.reasoning_text.done", **ref, content_index=0, text=part["text"]))
            out.append(self.event("response.content_part.done", **ref, content_index=0, part=part))
        out.append(self.event("response.output_item.done", output_index=index, item=x))
        return out

    def _kind(self) -> str | None:
        return self.open["type"] if self.open is not None else None

    def _add(self, item: dict) -> list[str]:
        out = self.close("open")
        self.items.append(item)
        self.open = item
        index = len(self.items) - 1
        out.append(self.event("response.output_item.added", output_index=index,
                              item={**item, "content": []} if "content" in item else dict(item)))
        if item["type"] != "function_call":
            part = {**item["content"][0]}
            out.append(self.event("response.content_part.added", item_id=item["id"], output_index=index,
                                  content_index=0, part=part))
        return out

    def _text_delta(self, kind: str, text: str, logprobs: list[dict]) -> list[str]:
        self.open["content"][0]["text"] += text
        fields = {"logprobs": logprobs} if kind == "response.output_text.delta" else {}
        return [self.event(kind, item_id=self.open["id"], output_index=len(self.items) - 1, content_index=0,
                           delta=text, **fields)]


async def response_events(ev: ResponseEvents, st, created: dict, stream, reply: Reply, top_n: int | None,
                          access: dict, arrival: float, done: Callable[[dict], Awaitable[None]]) -> AsyncIterator[str]:
    """The events of a streamed response from its engine stream, numbered by `ev` (whose `error` frames
    an engine failure); `done(response)` runs (stores it) before the last event goes out."""
    yield ev.event("response.created", response=created)
    yield ev.event("response.in_progress", response=created)
    delta, parts = ChoiceDelta(), reply.stream()
    held: tuple[list[int], list] = ([], [])             # tokens (and logprobs) whose text a parser holds
    finish, cached = None, 0
    async for out in stream:
        (o,) = out.outputs
        cached = out.num_cached_tokens
        d = delta.advance(o)
        if d is None:
            continue
        held[0].extend(d.token_ids)
        held[1].extend(d.logprobs)
        body, finish_reason = parts.feed(d.text, d.finish_reason)
        if not body and finish_reason is None:
            continue
        lps = chat_logprobs(st.token_text, *held, top_n)["content"] if top_n is not None else []
        held = ([], [])
        if access.get("ttft_s") is None and body:
            access["ttft_s"] = time.monotonic() - arrival
        access["output_tokens"] = delta.token_count
        for e in ev.feed(body, lps):
            yield e
        finish = finish_reason if finish_reason is not None else finish
    for e in ev.close(status_of(finish)):
        yield e
    reasoning = reasoning_text(ev.items)
    response = finished(created, ev.items, finish, usage(
        access["prompt_tokens"], delta.token_count, cached, count_tokens(st, reasoning)))
    await done(response)
    kind = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
    yield ev.event(kind, response=response)


def count_tokens(st, text: str) -> int:
    """Tokens in `text` (the reasoning's share of the output tokens)."""
    return len(st.tokenizer.encode(text, add_special_tokens=False)) if text else 0

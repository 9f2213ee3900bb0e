"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API over the chat pipeline.

A Messages body is mapped onto a chat completions request (`to_chat_request`) and run by the same code
as /v1/chat/completions: `chat.prepare` (checks, chat template, tools, SamplingParams), the engine, and
the tool-call parser (server/tools.py). Only the two ends differ: the body's shape on the way in, and
the reply's on the way out (content blocks, stop_reason, usage; streamed as Anthropic's events by
server/messages_reply.py). Errors on these paths take Anthropic's shape (server/errors.py).

The mapping, field by field:
- `system` (a string or text blocks) -> a system message; text blocks are joined by newlines.
- a `user` turn's text blocks -> a user message; each `tool_result` block -> a tool message (its
  `tool_use_id` as tool_call_id; `is_error: true` puts "Error: " before its text).
- an `assistant` turn's text blocks -> its content, its `tool_use` blocks -> its tool_calls.
- `tools` -> function tools (`input_schema` -> parameters); `tool_choice` auto / any / tool / none
  -> auto / required / a named function / none; `disable_parallel_tool_use` -> parallel_tool_calls.
- `stop_sequences` -> stop; `max_tokens`, `temperature`, `top_p`, `top_k` as they are.
- finish reasons -> stop_reason: a tool call -> tool_use, length -> max_tokens, a stop sequence ->
  stop_sequence (and `stop_sequence` names it), anything else -> end_turn.
- `thinking` {"type": "enabled"} (accepted only when the server runs --reasoning-parser) and
  {"type": "disabled"} -> chat_template_kwargs {"enable_thinking": true / false}, the switch of the
  templates that have one (Qwen3's; others ignore it); `budget_tokens` is not enforced. The reply's
  reasoning becomes a `thinking` block before the text (server/messages_reply.py). `thinking` and
  `redacted_thinking` blocks sent back in assistant turns are dropped from the prompt, as the thinking
  templates drop earlier turns' reasoning.
Anything else tokenfab cannot honour (image and document blocks, server tools, `container`, ...) is a
400 naming the field.
"""
from __future__ import annotations

import json
import re
import time
import uuid

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from tokenfab.server import chat
from tokenfab.server.errors import APIError, from_validation_errors, renamed
from tokenfab.server.messages_protocol import CountTokensRequest, MessagesRequest
from tokenfab.server.messages_reply import anthropic_error_event, content_blocks, message_events, stop_reason
from tokenfab.server.protocol import ChatCompletionRequest
from tokenfab.server.state import ServerState
from tokenfab.server.streaming import framed, sse_response

router = APIRouter()

# The fields each block may have; a field given as null counts as absent (the anthropic client's models
# dump their unset optional fields as null when an agent sends a reply's blocks back).
BLOCK_FIELDS = {"text": {"type", "text", "cache_control", "citations"},
                "thinking": {"type", "thinking", "signature"},
                "redacted_thinking": {"type", "data"},
                "tool_use": {"type", "id", "name", "input", "cache_control", "caller"},
                "tool_result": {"type", "tool_use_id", "content", "is_error", "cache_control"}}


@router.post("/v1/messages")
async def create_message(request: Request) -> Response:
    arrival = time.monotonic()
    st: ServerState = request.app.state.tokenfab
    req: MessagesRequest = await st.parse(request, MessagesRequest)
    chat_req = _checked(st, req)
    key = request.scope.get("state", {}).get("api_key")
    if key is not None:               # the key's service classes, on the request as chat sees it
        st.check_key(key, chat_req)
    p = await _prepare(st, chat_req)
    rid = f"msg_{uuid.uuid4().hex}"
    access = request.state.access = {"id": rid, "prompt_tokens": len(p.ids), "output_tokens": 0}
    (stream,) = await st.start(rid, [p.ids], p.params, 0, arrival, p.service_class)
    if req.stream:
        events = message_events(rid, req.model, stream, p.reply, req.stop_sequences, access, arrival)
        return sse_response(framed(events, [stream], access, error_event=anthropic_error_event, done=None), rid)
    (final,) = await st.collect(request, [stream])
    (o,) = final.outputs
    content, finish_reason = content_blocks(p.reply, o.text, o.finish_reason)
    reason, sequence = stop_reason(finish_reason, o.stop_reason, req.stop_sequences)
    m = final.metrics
    access.update(output_tokens=len(o.token_ids),
                  ttft_s=m.first_token_time - arrival if m and m.first_token_time else None)
    body = {"id": rid, "type": "message", "role": "assistant", "model": req.model, "content": content,
            "stop_reason": reason, "stop_sequence": sequence,
            "usage": {"input_tokens": len(p.ids), "output_tokens": len(o.token_ids)}}
    return JSONResponse(body, headers={"X-Request-Id": rid, "request-id": rid})


@router.post("/v1/messages/count_tokens")
async def count_tokens(request: Request) -> dict:
    st: ServerState = request.app.state.tokenfab
    req: CountTokensRequest = await st.parse(request, CountTokensRequest)
    chat_req = _checked(st, req)
    try:
        _, _, ids = await chat.chat_prompt(st, chat_req)
    except APIError as e:
        raise _in_anthropic_terms(e) from None
    return {"input_tokens": len(ids)}


def _checked(st: ServerState, req: CountTokensRequest) -> ChatCompletionRequest:
    st.check_model(req.model)
    bad = req.unsupported(reasoning=st.config.reasoning_parser is not None)
    if bad is not None:
        raise APIError(400, f"{bad[0]}: {bad[1]}", param=bad[0], code="unsupported")
    return to_chat_request(req)


async def _prepare(st: ServerState, chat_req: ChatCompletionRequest) -> chat.PreparedChat:
    try:
        return await chat.prepare(st, chat_req)
    except APIError as e:
        raise _in_anthropic_terms(e) from None


# chat's field names in its errors -> the Messages API's
_RENAMES = [(re.compile(r"tools\[(\d+)\]\.function\.parameters"), r"tools[\1].input_schema"),
            (re.compile(r"tools\[(\d+)\]\.function\.name"), r"tools[\1].name"),
            (re.compile(r"tool_choice\.function\.name"), "tool_choice.name"),
            (re.compile(r"\bstop( has| string)"), r"stop_sequences\1")]


def _in_anthropic_terms(e: APIError) -> APIError:
    e = renamed(e, _RENAMES)
    if e.param == "stop":
        e.param = "stop_sequences"
    return e


# -- the request: Messages -> chat ---------------------------------------------------------------
def to_chat_request(req: CountTokensRequest) -> ChatCompletionRequest:
    """The chat completions request that means what `req` means; a 400 naming the field for what has
    no meaning there."""
    body: dict = {"model": req.model, "messages": chat_messages(req)}
    if req.tools is not None:
        body["tools"] = [_tool(i, t) for i, t in enumerate(req.tools)]
    if req.tool_choice is not None:
        body["tool_choice"], body["parallel_tool_calls"] = _tool_choice(req.tool_choice)
    if req.thinking is not None:
        body["chat_template_kwargs"] = {"enable_thinking": req.thinking.get("type") == "enabled"}
    if isinstance(req, MessagesRequest):
        body.update(max_tokens=req.max_tokens, stream=req.stream)
        if req.stop_sequences is not None:
            body["stop"] = req.stop_sequences
        body.update({k: v for k in ("temperature", "top_p", "top_k") if (v := getattr(req, k)) is not None})
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as e:
        raise from_validation_errors(e.errors()) from None


def chat_messages(req: CountTokensRequest) -> list[dict]:
    out: list[dict] = []
    if req.system is not None:
        out.append({"role": "system", "content": _text(req.system, "system")})
    for i, m in enumerate(req.messages):
        blocks = [{"type": "text", "text": m.content}] if isinstance(m.content, str) else m.content
        texts: list[str] = []
        calls: list[dict] = []
        for j, b in enumerate(blocks):
            where = f"messages[{i}].content[{j}]"
            kind = _block_type(b, where)
            if kind == "text":
                texts.append(b["text"])
            elif kind in ("thinking", "redacted_thinking") and m.role == "assistant":
                continue                   # earlier reasoning: not part of the prompt
            elif kind == "tool_use" and m.role == "assistant":
                calls.append(_tool_call(b, where))
            elif kind == "tool_result" and m.role == "user":
                if texts:                  # text before a result stays before it
                    out.append({"role": "user", "content": "\n".join(texts)})
                    texts = []
                out.append(_tool_message(b, where))
            else:
                belongs = "a user" if kind == "tool_result" else "an assistant"
                raise APIError(400, f"{where}: a {kind} block belongs in {belongs} message, not a {m.role} one",
                               param=where, code="invalid_value")
        if m.role == "assistant":
            out.append({"role": "assistant", "content": "\n".join(texts), **({"tool_calls": calls} if calls else {})})
        elif texts or not isinstance(m.content, list) or not m.content:
            out.append({"role": "user", "content": "\n".join(texts)})
    return out


def _block_type(b, where: str) -> str:
    kind = b.get("type") if isinstance(b, dict) else None
    if not isinstance(kind, str) or kind not in BLOCK_FIELDS:
        raise APIError(400, f"{where}.type {kind!r} is not supported: tokenfab's /v1/messages takes text, tool_use "
                            "and tool_result blocks, and thinking blocks in assistant turns (no images, documents or "
                            "server-tool blocks)",
                       param=f"{where}.type", code="unsupported")
    extra = sorted(k for k, v in b.items() if k not in BLOCK_FIELDS[kind] and v is not None)
    if b.get("citations") is not None:
        extra.insert(0, "citations")
    if b.get("caller") not in (None, {"type": "direct"}):      # a call made by a server tool
        extra.insert(0, "caller")
    if extra:
        raise APIError(400, f"{where}.{extra[0]} is not supported in a {kind} block", param=f"{where}.{extra[0]}",
                       code="unsupported")
    if kind == "text" and not isinstance(b.get("text"), str):
        raise APIError(400, f"{where}.text must be a string", param=f"{where}.text", code="invalid_value")
    return kind


def _text(value: str | list, where: str) -> str:
    """A string, or text blocks joined by newlines."""
    if isinstance(value, str):
        return value
    return "\n".join(b["text"] for j, b in enumerate(value) if _text_only(b, f"{where}[{j}]"))


def _text_only(b, where: str) -> bool:
    if _block_type(b, where) != "text":
        raise APIError(400, f"{where} must be a text block", param=f"{where}.type", code="invalid_value")
    return True


def _tool_call(b: dict, where: str) -> dict:
    if not isinstance(b.get("id"), str) or not isinstance(b.get("name"), str) or not isinstance(b.get("input"), dict):
        raise APIError(400, f"{where} must be {{\"type\": \"tool_use\", \"id\": string, \"name\": string, "
                            "\"input\": object}", param=where, code="invalid_value")
    return {"id": b["id"], "type": "function",
            "function": {"name": b["name"], "arguments": json.dumps(b["input"], ensure_ascii=False)}}


def _tool_message(b: dict, where: str) -> dict:
    if not isinstance(b.get("tool_use_id"), str):
        raise APIError(400, f"{where}.tool_use_id must be a string", param=f"{where}.tool_use_id", code="invalid_value")
    content = b.get("content", "")
    if not isinstance(content, (str, list)):
        raise APIError(400, f"{where}.content must be a string or text blocks", param=f"{where}.content",
                       code="invalid_value")
    text = _text(content, f"{where}.content")
    if b.get("is_error"):
        text = f"Error: {text}"
    return {"role": "tool", "tool_call_id": b["tool_use_id"], "content": text}


def _tool(i: int, t) -> dict:
    if t.type not in (None, "custom"):
        raise APIError(400, f"tools[{i}].type {t.type!r} is not supported: tokenfab runs no server tools; give "
                            "client tools ({name, description, input_schema})", param=f"tools[{i}].type",
                       code="unsupported")
    fn = {"name": t.name, "parameters": t.input_schema}
    if t.description is not None:
        fn["description"] = t.description
    return {"type": "function", "function": fn}


def _tool_choice(tc: dict) -> tuple[object, bool]:
    """(chat's tool_choice, parallel_tool_calls)."""
    kind = tc.get("type")
    extra = sorted(set(tc) - {"type", "name", "disable_parallel_tool_use"})
    if extra:
        raise APIError(400, f"tool_choice.{extra[0]} is not a known field", param=f"tool_choice.{extra[0]}",
                       code="unknown_field")
    no_parallel = tc.get("disable_parallel_tool_use", False)
    if not isinstance(no_parallel, bool):
        raise APIError(400, "tool_choice.disable_parallel_tool_use must be a boolean",
                       param="tool_choice.disable_parallel_tool_use", code="invalid_value")
    if kind == "tool":
        if not isinstance(tc.get("name"), str):
            raise APIError(400, "tool_choice {\"type\": \"tool\"} needs the tool's name",
                           param="tool_choice.name", code="invalid_value")
        return {"type": "function", "function": {"name": tc["name"]}}, not no_parallel
    choices = {"auto": "auto", "any": "required", "none": "none"}
    if not isinstance(kind, str) or kind not in choices:
        raise APIError(400, f"tool_choice.type {kind!r} is not auto, any, tool or none", param="tool_choice.type",
                       code="invalid_value")
    return choices[kind], not no_parallel

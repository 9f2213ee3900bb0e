"""A Responses API request -> the chat completions request that means the same, and its input items.

/v1/responses runs on the chat pipeline as /v1/messages does: its body is mapped onto a
ChatCompletionRequest (`to_chat_request`), which `chat.prepare` checks and turns into a prompt and
SamplingParams. The mapping, field by field:

- `input`: a string is one user message. Items, in order:
  - `message` (role user / system / developer / assistant; content a string or `input_text` parts, an
    assistant's `output_text` or `refusal` parts) -> a chat message, parts joined by newlines;
  - `function_call` -> a tool call of an assistant message (consecutive calls, and the assistant text
    right before them, make one message);
  - `function_call_output` -> a tool message (`call_id` as tool_call_id; text parts joined);
  - `reasoning` -> nothing: earlier reasoning is not part of the prompt, as the thinking templates
    drop it.
- `instructions` -> a system message before the input (a previous response's instructions are not
  carried over, as OpenAI defines it).
- `tools` (function tools: name, description, parameters, strict) -> chat's function tools;
  `tool_choice` none / auto / required / {"type": "function", "name"} -> chat's; `parallel_tool_calls`.
- `text.format` json_schema / json_object / text -> `response_format`, i.e. structured output.
- `max_output_tokens` -> max_completion_tokens; `temperature`, `top_p`, `service_tier`, `user` as they are.
- `include: ["message.output_text.logprobs"]` with `top_logprobs` -> logprobs.
- `reasoning.effort` "none" -> chat_template_kwargs enable_thinking false, any other effort (only with
  --reasoning-parser) -> true: the switch of the templates that have one; the effort is not a budget.

Every item is also given the canonical shape `input_items` lists (an id, content as parts, a status).
What cannot be honoured (image and file parts, built-in tools, item references) is a 400 naming it.
"""
from __future__ import annotations

import json
import re
import uuid

from pydantic import ValidationError

from tokenfab.server.errors import APIError, from_validation_errors, renamed
from tokenfab.server.protocol import ChatCompletionRequest
from tokenfab.server.responses_protocol import ResponsesRequest

# The fields each input item may have; a field given as null counts as absent (the openai client's
# models dump their unset optional fields as null when an agent sends a response's output back).
ITEM_FIELDS = {"message": {"type", "role", "content", "id", "status", "phase"},
               "function_call": {"type", "call_id", "name", "arguments", "id", "status", "caller"},
               "function_call_output": {"type", "call_id", "output", "id", "status", "caller"},
               "reasoning": {"type", "id", "summary", "content", "status"}}
PART_FIELDS = {"input_text": {"type", "text"}, "output_text": {"type", "text", "annotations", "logprobs"},
               "refusal": {"type", "refusal"}}
ID_PREFIXES = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}
ROLES = ("user", "system", "developer", "assistant")


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


# -- input items ---------------------------------------------------------------------------------
def input_items(req: ResponsesRequest) -> list[dict]:
    """The request's `input` as canonical items, each checked and given an id."""
    if isinstance(req.input, str):
        return [{"id": new_id("msg"), "type": "message", "role": "user", "status": "completed",
                 "content": [{"type": "input_text", "text": req.input}]}]
    if not req.input:
        raise APIError(400, "input must be a string or a non-empty list of items", param="input", code="invalid_value")
    return [_item(x, f"input[{i}]") for i, x in enumerate(req.input)]


def _item(x: dict, where: str) -> dict:
    kind = x.get("type", "message" if "role" in x else None)
    if not isinstance(kind, str) or kind not in ITEM_FIELDS:
        raise APIError(400, f"{where}.type {kind!r} is not supported: tokenfab's /v1/responses takes message, "
                            "function_call, function_call_output and reasoning items (no item references, "
                            "built-in tool calls or images)", param=f"{where}.type", code="unsupported")
    _check_fields(x, ITEM_FIELDS[kind], where, f"a {kind} item")
    if x.get("caller") not in (None, {"type": "direct"}):         # a call made by a program, not the model
        raise APIError(400, f"{where}.caller is not supported", param=f"{where}.caller", code="unsupported")
    out = {"id": x.get("id") or new_id(ID_PREFIXES[kind]), "type": kind}
    if kind == "message":
        role = x.get("role")
        if role not in ROLES:
            raise APIError(400, f"{where}.role must be one of {', '.join(ROLES)}, got {role!r}",
                           param=f"{where}.role", code="invalid_value")
        out.update(role=role, content=_parts(x.get("content"), role, f"{where}.content"), status="completed")
    elif kind == "function_call":
        for f in ("call_id", "name", "arguments"):
            _string(x, f, where)
        out.update(call_id=x["call_id"], name=x["name"], arguments=x["arguments"], status="completed")
    elif kind == "function_call_output":
        _string(x, "call_id", where)
        output = x.get("output")
        if not isinstance(output, str):
            output = _parts(output, "user", f"{where}.output")
        out.update(call_id=x["call_id"], output=output, status="completed")
    else:
        for f in ("summary", "content"):
            if not isinstance(x.get(f) or [], list):
                raise APIError(400, f"{where}.{f} must be a list", param=f"{where}.{f}", code="invalid_value")
        out.update(summary=x.get("summary") or [], content=x.get("content") or [], status="completed")
    return out


def _check_fields(x: dict, allowed: set[str], where: str, what: str) -> None:
    extra = sorted(k for k, v in x.items() if k not in allowed and v is not None)
    if extra:
        raise APIError(400, f"{where}.{extra[0]} is not supported in {what}", param=f"{where}.{extra[0]}",
                       code="unsupported")


def _string(x: dict, field: str, where: str) -> None:
    if not isinstance(x.get(field), str):
        raise APIError(400, f"{where}.{field} must be a string", param=f"{where}.{field}", code="invalid_value")


def _parts(content, role: str, where: str) -> list[dict]:
    """Message content as parts: a string is one input_text part (output_text in an assistant's)."""
    if isinstance(content, str):
        return [{"type": "output_text" if role == "assistant" else "input_text", "text": content}
                | ({"annotations": []} if role == "assistant" else {})]
    if not isinstance(content, list):
        raise APIError(400, f"{where} must be a string or a list of content parts", param=where, code="invalid_value")
    allowed = ("output_text", "refusal") if role == "assistant" else ("input_text",)
    for j, p in enumerate(content):
        kind = p.get("type") if isinstance(p, dict) else None
        if kind not in allowed:
            raise APIError(400, f"{where}[{j}].type {kind!r} is not supported in a {role} message: tokenfab takes "
                                f"{' and '.join(allowed)} parts (no images, files or audio)",
                           param=f"{where}[{j}].type", code="unsupported")
        _check_fields(p, PART_FIELDS[kind], f"{where}[{j}]", f"an {kind} part")
        _string(p, "refusal" if kind == "refusal" else "text", f"{where}[{j}]")
    return content


def _text(parts: list[dict] | str) -> str:
    if isinstance(parts, str):
        return parts
    return "\n".join(p.get("text", p.get("refusal", "")) for p in parts)


def chat_messages(instructions: str | None, items: list[dict]) -> list[dict]:
    """Chat messages for canonical items, after `instructions` as a system message."""
    out: list[dict] = [{"role": "system", "content": instructions}] if instructions is not None else []
    for x in items:
        kind = x["type"]
        if kind == "message":
            out.append({"role": x["role"], "content": _text(x["content"])})
        elif kind == "function_call":
            last = out[-1] if out else None
            if last is None or last["role"] != "assistant":
                last = {"role": "assistant", "content": ""}
                out.append(last)
            last.setdefault("tool_calls", []).append(
                {"id": x["call_id"], "type": "function", "function": {"name": x["name"], "arguments": x["arguments"]}})
        elif kind == "function_call_output":
            out.append({"role": "tool", "tool_call_id": x["call_id"], "content": _text(x["output"])})
    if not out:
        raise APIError(400, "the input has no messages (reasoning items alone are no prompt)", param="input",
                       code="invalid_value")
    return out


# -- the request: Responses -> chat ----------------------------------------------------------------
def to_chat_request(req: ResponsesRequest, items: list[dict]) -> ChatCompletionRequest:
    """The chat completions request for `req` whose conversation is `items` (its own input after what a
    previous response held); a 400 naming the field for what has no meaning there."""
    body: dict = {"messages": chat_messages(req.instructions, items), "stream": bool(req.stream)}
    if req.model is not None:
        body["model"] = req.model
    if req.tools is not None:
        body["tools"] = [_tool(i, t) for i, t in enumerate(req.tools)]
    if req.tool_choice is not None:
        body["tool_choice"] = _tool_choice(req.tool_choice)
    if req.parallel_tool_calls is not None:
        body["parallel_tool_calls"] = req.parallel_tool_calls
    fmt = text_format(req)
    if fmt["type"] == "json_schema":
        body["response_format"] = {"type": "json_schema", "json_schema": {
            k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}}
    elif fmt["type"] == "json_object":
        body["response_format"] = {"type": "json_object"}
    if req.include:
        body.update(logprobs=True, top_logprobs=req.top_logprobs or 0)
    effort = (req.reasoning or {}).get("effort")
    if effort is not None:
        body["chat_template_kwargs"] = {"enable_thinking": effort != "none"}
    if req.max_output_tokens is not None:
        body["max_completion_tokens"] = req.max_output_tokens
    body.update({k: v for k in ("temperature", "top_p", "service_tier", "user") if (v := getattr(req, k)) is not None})
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as e:
        raise in_responses_terms(from_validation_errors(e.errors())) from None


def text_format(req: ResponsesRequest) -> dict:
    """`text.format`, checked; {"type": "text"} when absent."""
    fmt = (req.text or {}).get("format") or {"type": "text"}
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind in ("text", "json_object"):
        _check_fields(fmt, {"type"}, "text.format", f"a {kind} format")
    elif kind == "json_schema":
        _check_fields(fmt, {"type", "name", "schema", "strict", "description"}, "text.format", "a json_schema format")
        if not isinstance(fmt.get("name"), str) or not isinstance(fmt.get("schema"), dict):
            raise APIError(400, "text.format json_schema needs a name (string) and a schema (object)",
                           param="text.format.schema", code="invalid_value")
    else:
        raise APIError(400, f"text.format.type {kind!r} is not one of text, json_object, json_schema",
                       param="text.format.type", code="invalid_value")
    return fmt


def _tool(i: int, t) -> dict:
    if not isinstance(t, dict) or t.get("type") != "function":
        kind = t.get("type") if isinstance(t, dict) else None
        raise APIError(400, f"tools[{i}].type {kind!r} is not supported: tokenfab runs no built-in tools (web "
                            "search, file search, code interpreter, MCP, ...); give function tools "
                            "({type: \"function\", name, parameters})", param=f"tools[{i}].type", code="unsupported")
    _check_fields(t, {"type", "name", "description", "parameters", "strict"}, f"tools[{i}]", "a function tool")
    return {"type": "function", "function": {k: v for k, v in t.items() if k != "type" and v is not None}}


def _tool_choice(tc) -> object:
    if isinstance(tc, str):
        return tc                           # none / auto / required; chat checks the value
    if tc.get("type") == "function" and set(tc) <= {"type", "name"} and isinstance(tc.get("name"), str):
        return {"type": "function", "function": {"name": tc["name"]}}
    raise APIError(400, f"tool_choice {json.dumps(tc)[:80]} is not supported: give none, auto, required or "
                        "{\"type\": \"function\", \"name\": ...} (no allowed_tools, built-in or MCP tools)",
                   param="tool_choice", code="unsupported")


# chat's field names in its errors -> the Responses API's
_RENAMES = [(re.compile(r"tools\[(\d+)\]\.function\.(parameters|name)"), r"tools[\1].\2"),
            (re.compile(r"tool_choice\.function\.name"), "tool_choice.name"),
            (re.compile(r"\bmax_completion_tokens\b"), "max_output_tokens"),
            (re.compile(r"\bresponse_format(\.json_schema)?(\.schema)?\b"), r"text.format\2"),
            (re.compile(r"^messages\b"), "input")]


def in_responses_terms(e: APIError) -> APIError:
    return renamed(e, _RENAMES)

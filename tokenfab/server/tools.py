"""Tool calling on /v1/chat/completions (and /v1/messages, mapped onto it): `tools`, `tool_choice`,
`parallel_tool_calls`.

- The tools reach the model through its chat template (`apply_chat_template(tools=...)`) when the
  template has a tool format (it mentions `tools`). Templates without one (SmolLM2's) get the tools
  in the system message, in a Hermes-style prompt: the tools' JSON inside <tools></tools>, and
  calls asked for as <tool_call>{"name": ..., "arguments": {...}}</tool_call>.
- Earlier turns round-trip: assistant `tool_calls` and `role: "tool"` results go to a tool-aware
  template as HF's message format, and to other templates as the same Hermes-style text
  (<tool_call>...</tool_call> in the assistant turn, <tool_response>...</tool_response> in the tool turn).
- `auto` generates freely and parses (server/tool_parsers.py); `required` and a named function are
  enforced by a grammar (a call wrapper around the functions' parameter schemas, engine/structured.py),
  so the arguments always parse and validate against the function's schema. `none` leaves the tools
  out of the prompt.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

from tokenfab.chat_format import tool_response, with_tools_prompt
from tokenfab.engine.structured import JSON_DEFAULTS
from tokenfab.server.errors import APIError
from tokenfab.server.tool_parsers import HermesToolParser, merge_deltas, parser_for
from tokenfab.structured_output import StructuredOutputParams

_NAME_OK = re.compile(r"^[A-Za-z0-9_-]{1,64}$")    # OpenAI's rule for function names



@dataclass
class ToolPlan:
    tools: list[dict]               # the request's tools, validated
    choice: str                     # "none" | "auto" | "required" | "named"
    named: str | None
    parallel: bool
    parser: HermesToolParser

    @property
    def parses(self) -> bool:
        return self.choice != "none"

    def structure(self) -> StructuredOutputParams | None:
        """The grammar that forces a call (required / named), else None."""
        if self.choice not in ("required", "named"):
            return None
        fns = [t["function"] for t in self.tools if self.choice == "required" or t["function"]["name"] == self.named]
        alts = [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                 "properties": {"name": {"const": f["name"]},
                                "arguments": f.get("parameters") or {"type": "object"}}} for f in fns]
        schema = {**(alts[0] if len(alts) == 1 else {"anyOf": alts}), "x-guidance": JSON_DEFAULTS}
        call = f'"{self.parser.start}\\n" %json {json.dumps(schema)} "\\n{self.parser.end}"'
        repeat = ' ("\\n" call)*' if self.parallel and self.choice == "required" else ""
        return StructuredOutputParams(grammar=f"start: call{repeat}\ncall: {call}\n")


def plan_tools(req, parser_name: str | None = None) -> ToolPlan | None:
    """Validate tools / tool_choice; None when the request has no tools (or tool_choice none and no tools)."""
    tools, choice = req.tools, req.tool_choice
    if not tools:
        if choice not in (None, "none"):
            raise APIError(400, "tool_choice needs tools", param="tool_choice", code="invalid_value")
        return None
    if not isinstance(tools, list):
        raise APIError(400, "tools must be a list of {\"type\": \"function\", \"function\": {...}}",
                       param="tools", code="invalid_value")
    names = []
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(fn, dict):
            raise APIError(400, f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ..., "
                                "\"parameters\": {...}}}}", param=f"tools[{i}]", code="invalid_value")
        if not isinstance(fn.get("name"), str) or not _NAME_OK.match(fn["name"]):
            raise APIError(400, f"tools[{i}].function.name must be 1-64 letters, digits, _ or -; got "
                                f"{fn.get('name')!r}", param=f"tools[{i}].function.name", code="invalid_value")
        if fn["name"] in names:
            raise APIError(400, f"two tools are named {fn['name']!r}", param=f"tools[{i}].function.name",
                           code="invalid_value")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise APIError(400, f"tools[{i}].function.parameters must be a JSON schema object",
                           param=f"tools[{i}].function.parameters", code="invalid_value")
        names.append(fn["name"])
    named = None
    if choice is None:
        choice = "auto"
    elif isinstance(choice, dict):
        fn = choice.get("function") if choice.get("type") == "function" else None
        named = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(named, str):
            raise APIError(400, "tool_choice must be none, auto, required or {\"type\": \"function\", "
                                "\"function\": {\"name\": ...}}", param="tool_choice", code="invalid_value")
        if named not in names:
            raise APIError(400, f"tool_choice names the function {named!r}, which is not in tools "
                                f"({', '.join(names)})", param="tool_choice.function.name", code="invalid_value")
        choice = "named"
    elif choice not in ("none", "auto", "required"):
        raise APIError(400, f"tool_choice {choice!r} is not none, auto, required or a named function",
                       param="tool_choice", code="invalid_value")
    return ToolPlan([{"type": "function", "function": t["function"]} for t in tools], choice, named,
                    req.parallel_tool_calls, parser_for(None, parser_name))


async def check_tool_schemas(client, plan: ToolPlan) -> None:
    """Each function's parameter schema must compile (a 400 naming the tool, not a failure later)."""
    from tokenfab.server.structured import check_compiles
    for i, t in enumerate(plan.tools):
        params = t["function"].get("parameters")
        if params:
            await check_compiles(client, StructuredOutputParams(json=params), f"tools[{i}].function.parameters")


def template_supports_tools(tokenizer) -> bool:
    tpl = getattr(tokenizer, "chat_template", None)
    return isinstance(tpl, str) and "tools" in tpl


class InvalidToolCalls(ValueError):
    """An assistant message's `tool_calls` that cannot be rendered; `param` names it."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def template_input(tokenizer, messages: list[dict], plan: ToolPlan | None,
                   parser_name: str | None = None) -> tuple[list[dict], dict]:
    """(messages, extra apply_chat_template kwargs) for the conversation and the tools; InvalidToolCalls
    for a history message whose tool_calls are malformed."""
    parser = plan.parser if plan else parser_for(None, parser_name)
    for k, m in enumerate(messages):       # checked here, once, whichever way they are rendered below
        for i, c in enumerate(m.get("tool_calls") or ()):
            try:
                _call_fields(c, i)
            except ValueError as e:
                raise InvalidToolCalls(f"messages[{k}].{e}", f"messages[{k}].tool_calls[{i}]") from None
    tools = plan.tools if plan and plan.choice != "none" else None
    if template_supports_tools(tokenizer):
        msgs = [_native_message(m) for m in messages]
        return msgs, ({"tools": tools} if tools else {})
    return with_tools_prompt([_text_message(m, parser) for m in messages], tools), {}


def _call_fields(call: dict, i: int) -> tuple[str, object]:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise ValueError(f"tool_calls[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\", \"arguments\"}}}}")
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            pass                    # kept as the model's text
    return fn["name"], args


def _native_message(m: dict) -> dict:
    if not m.get("tool_calls"):
        return m
    calls = []
    for i, c in enumerate(m["tool_calls"]):
        name, args = _call_fields(c, i)
        calls.append({"id": c.get("id"), "type": "function", "function": {"name": name, "arguments": args}})
    return {**m, "tool_calls": calls}


def _text_message(m: dict, parser: HermesToolParser) -> dict:
    m = dict(m)
    calls = m.pop("tool_calls", None)
    m.pop("tool_call_id", None)
    if calls:
        text = "\n".join(parser.format_call(*_call_fields(c, i)) for i, c in enumerate(calls))
        m["content"] = f"{m['content']}\n{text}" if m.get("content") else text
    if m["role"] == "tool":
        m["content"] = tool_response(m.get("content"))
    return m


# -- the route's side ----------------------------------------------------------------------------
async def chat_constraints(st, req) -> tuple[ToolPlan | None, StructuredOutputParams | None]:
    """The tool plan and the structured-output spec of a chat request, both checked (compiled) before
    anything is queued: a bad schema or tool_choice is a 400 naming its field."""
    from tokenfab.server.structured import check_compiles, requested_structure
    plan = plan_tools(req, st.config.tool_call_parser)
    spec, param = requested_structure(req)
    forced = plan.structure() if plan else None
    if forced is not None:
        if spec is not None:
            raise APIError(400, f"{param} cannot be combined with tool_choice {plan.choice!r} (the call's "
                                "format is already enforced)", param=param, code="invalid_value")
        spec, param = forced, "tools"
    if plan is not None:
        await check_tool_schemas(st.client, plan)
    if spec is not None:
        await check_compiles(st.client, spec, param)
    return plan, spec


def assistant_message(plan: ToolPlan | None, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
    """The non-streamed choice's message and finish_reason ("tool_calls" when the model called)."""
    if plan is None or not plan.parses:
        return {"role": "assistant", "content": text}, finish_reason
    content, calls = plan.parser.parse(text)
    if not calls:
        return {"role": "assistant", "content": text}, finish_reason
    msg = {"role": "assistant", "content": content, "tool_calls": [c.as_openai() for c in calls]}
    return msg, "tool_calls" if finish_reason == "stop" else finish_reason


def stream_delta(stream, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
    """One streamed chunk's delta for a choice whose text goes through a tool parser's stream."""
    content, calls = stream.feed(text)
    if finish_reason is not None:
        more, last = stream.finish()
        content, calls = content + more, merge_deltas(calls + last)
    delta = {}
    if content:
        delta["content"] = content
    if calls:
        delta["tool_calls"] = calls
    if finish_reason == "stop" and stream.num_calls:
        finish_reason = "tool_calls"
    return delta, finish_reason

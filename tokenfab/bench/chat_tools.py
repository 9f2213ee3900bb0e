"""How the bench renders tools, tool calls and tool results for counting a chat prompt's tokens.

A template with a tool format (one that mentions `tools`) gets them as Hugging Face's message format:
`tools=` for apply_chat_template, assistant `tool_calls` with their arguments as objects, `role: "tool"`
results. A template without one gets the Hermes convention that servers fall back to (tokenfab's and
others'): the tools' JSON in the system message, calls as <tool_call> text in the assistant turn,
results as <tool_response> text in a user turn. A server that renders tools its own way counts a few
tokens differently; each request records the server's own count (`server_prompt_tokens`).
"""
from __future__ import annotations

import json

TOOLS_PROMPT = ("# Tools\n\nYou can call functions to help answer the user. Their signatures, as JSON, are "
                "inside <tools></tools>:\n<tools>\n{tools}\n</tools>\n\nTo call a function, write a JSON object "
                "with its name and arguments inside <tool_call></tool_call> tags.")


def native_message(m: dict) -> dict:
    """A message for a tool-aware template: content never None, call arguments as objects."""
    out = {**m, "content": m.get("content") or ""}
    if m.get("tool_calls"):
        out["tool_calls"] = [{**c, "function": {**c["function"], "arguments": _args(c["function"]["arguments"])}}
                             for c in m["tool_calls"]]
    return out


def as_plain_messages(messages: list[dict], tools: list[dict] | None) -> list[dict]:
    """The conversation with text contents only and the roles every template knows."""
    out = []
    for m in messages:
        content = m.get("content") or ""
        if m.get("tool_calls"):
            content += "".join("\n<tool_call>\n" + json.dumps({"name": c["function"]["name"],
                                                               "arguments": _args(c["function"]["arguments"])})
                               + "\n</tool_call>" for c in m["tool_calls"])
        if m["role"] == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"})
        else:
            out.append({"role": m["role"], "content": content})
    if tools:
        text = TOOLS_PROMPT.format(tools="\n".join(json.dumps(t) for t in tools))
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{text}"}
        else:
            out.insert(0, {"role": "system", "content": text})
    return out


def _args(arguments):
    if isinstance(arguments, str):
        try:
            return json.loads(arguments) if arguments.strip() else {}
        except ValueError:
            return arguments
    return arguments

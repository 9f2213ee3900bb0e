"""How the bench renders tools, tool calls and tool results for counting a chat prompt's tokens.

A template with a tool format (one that mentions `tools`) gets them as Hugging Face's message format:
`tools=` for apply_chat_template, assistant `tool_calls` with their arguments as objects, `role: "tool"`
results. A template without one gets the Hermes-style text that `tokenfab serve` falls back to
(server/tools.py), word for word: the tools' JSON in the system message, calls as <tool_call> text in
the assistant turn, results as <tool_response> text in the tool turn. A server that renders tools its
own way counts some tokens differently; each request records the server's own count
(`server_prompt_tokens`), so the difference is visible.
"""
from __future__ import annotations

import json

TOOLS_PROMPT = """# Tools

You can call functions to help answer the user. Their signatures, as JSON, are inside <tools></tools>:
<tools>
{tools}
</tools>

To call a function, write a JSON object with its name and arguments inside <tool_call></tool_call> tags:
<tool_call>
{{"name": "<function name>", "arguments": {{<arguments as a JSON object>}}}}
</tool_call>"""


def native_message(m: dict) -> dict:
    """A message for a tool-aware template: content never None, call arguments as objects."""
    out = {**m, "content": m.get("content") or ""}
    if m.get("tool_calls"):
        out["tool_calls"] = [{**c, "function": {**c["function"], "arguments": _args(c["function"]["arguments"])}}
                             for c in m["tool_calls"]]
    return out


def as_plain_messages(messages: list[dict], tools: list[dict] | None) -> list[dict]:
    """The conversation as plain text messages, the tools in the system message (the Hermes-style fallback)."""
    out = []
    for m in messages:
        content = m.get("content") or ""
        if m.get("tool_calls"):
            calls = "\n".join("<tool_call>\n" + json.dumps({"name": c["function"]["name"],
                                                            "arguments": _args(c["function"]["arguments"])},
                                                           ensure_ascii=False) + "\n</tool_call>"
                              for c in m["tool_calls"])
            content = f"{content}\n{calls}" if content else calls
        if m["role"] == "tool":
            content = f"<tool_response>\n{content}\n</tool_response>"
        out.append({"role": m["role"], "content": content})
    if tools:
        text = TOOLS_PROMPT.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
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

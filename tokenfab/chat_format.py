"""How tokenfab writes tools, tool calls and tool results as text for chat templates without a tool format
(the Hermes style): the tools' JSON in the system message, each call as <tool_call> JSON in the assistant
turn, each result inside <tool_response> in the tool turn.

A leaf: the server renders prompts with it (server/tools.py) and bench counts the same prompts' tokens with
it (bench/chat_tools.py), word for word, without either importing the other.
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

CALL_START, CALL_END = "<tool_call>", "</tool_call>"


def format_call(name: str, arguments) -> str:
    """One call as the model should write it (prompts and earlier assistant turns)."""
    return f'{CALL_START}\n{json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)}\n{CALL_END}'


def tool_response(content: str | None) -> str:
    """A tool message's content as the template sees it."""
    return f"<tool_response>\n{content or ''}\n</tool_response>"


def with_tools_prompt(messages: list[dict], tools: list[dict] | None) -> list[dict]:
    """`messages` with the tools' prompt appended to the system message (or put first as one)."""
    if not tools:
        return messages
    text = TOOLS_PROMPT.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
    if messages and messages[0]["role"] == "system":
        return [{**messages[0], "content": f"{messages[0]['content']}\n\n{text}"}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]

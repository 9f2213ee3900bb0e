"""Tool-call parsers: a model's output text -> OpenAI `tool_calls`, whole or as streamed deltas.

One parser per model family, chosen from a small registry. `hermes` reads the format of Hermes,
Qwen2/2.5/3 and tokenfab's own fallback prompt (server/tools.py), one JSON object per call:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Streaming follows OpenAI's deltas: the first delta of call k carries its index, id, type and function
name; later ones carry fragments of `arguments` whose concatenation is the arguments' JSON text.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from tokenfab.chat_format import CALL_END, CALL_START, format_call


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(slots=True)
class ToolCall:
    name: str
    arguments: str                      # JSON text, as OpenAI sends it
    id: str = field(default_factory=new_call_id)

    def as_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


_NAME = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"')
_ARGS = re.compile(r'"arguments"\s*:\s*')


class HermesToolParser:
    start, end = CALL_START, CALL_END

    def format_call(self, name: str, arguments) -> str:
        """One call as the model should write it (prompts and earlier assistant turns)."""
        return format_call(name, arguments)

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content outside the calls, or None when there is none; the calls). A call that is not valid
        JSON with a string `name` stays in the content, so nothing the model wrote is lost."""
        calls, content, pos = [], [], 0
        for m in re.finditer(re.escape(self.start) + r"(.*?)(?:" + re.escape(self.end) + r"|\Z)", text, re.S):
            call = _decode_call(m.group(1))
            if call is None:
                continue
            content.append(text[pos:m.start()])
            calls.append(call)
            pos = m.end()
        content.append(text[pos:])
        rest = "".join(content).strip() if calls else "".join(content)
        return (rest or None), calls

    def streamer(self) -> "HermesStream":
        return HermesStream(self)


def _decode_call(body: str) -> ToolCall | None:
    try:
        obj = json.loads(body.strip())
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return ToolCall(obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag` (it may become the tag)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class HermesStream:
    """Incremental parsing of one choice's text. `feed(delta)` and finally `finish()` each return
    (content to send, tool-call delta entries to send)."""

    def __init__(self, parser: HermesToolParser) -> None:
        self.p = parser
        self.buf = ""
        self.in_call = False
        self.body = ""
        self.calls: list[ToolCall] = []      # calls whose first delta went out
        self.sent_args = 0                   # chars of the current call's arguments sent
        self.args_at: int | None = None      # where the current call's arguments start in body

    @property
    def num_calls(self) -> int:
        return len(self.calls)

    def feed(self, text: str) -> tuple[str, list[dict]]:
        self.buf += text
        content, deltas = "", []
        while True:
            if not self.in_call:
                i = self.buf.find(self.p.start)
                if i < 0:
                    keep = partial_suffix(self.buf, self.p.start)
                    content += self._content(self.buf[: len(self.buf) - keep])
                    self.buf = self.buf[len(self.buf) - keep:]
                    break
                content += self._content(self.buf[:i])
                self.buf = self.buf[i + len(self.p.start):]
                self.in_call, self.body, self.sent_args, self.args_at = True, "", 0, None
                continue
            self.body += self.buf
            self.buf = ""
            j = self.body.find(self.p.end)
            if j < 0:
                deltas += self._progress(self.body[: len(self.body) - partial_suffix(self.body, self.p.end)])
                break
            self.buf = self.body[j + len(self.p.end):]
            self.body = self.body[:j]
            c, d = self._close()
            content, deltas = content + self._content(c), deltas + d
        return content, merge_deltas(deltas)

    def finish(self) -> tuple[str, list[dict]]:
        content, deltas = "", []
        if self.in_call:                 # ended inside a call (EOS or max_tokens): close what is there
            self.body += self.buf
            content, deltas = self._close()
        else:
            content = self.buf
        self.buf = ""
        return self._content(content), merge_deltas(deltas)

    def _content(self, text: str) -> str:
        # Between and after calls the model writes newlines; they are not content worth sending.
        return "" if self.calls and not text.strip() else text

    def _progress(self, body: str) -> list[dict]:
        out = []
        if self.args_at is None:
            m = _NAME.match(body)
            a = _ARGS.search(body, m.end()) if m else None
            if m is None or a is None:
                return out
            try:
                name = json.loads(f'"{m.group(1)}"')
            except ValueError:
                return out
            self.calls.append(ToolCall(name, ""))
            self.args_at = a.end()
            out.append(self._first_delta())
        if self.sent_args == 0:          # the arguments start at their first non-space character
            rest = body[self.args_at:]
            self.args_at += len(rest) - len(rest.lstrip())
        # Send the arguments up to their last character that cannot be the call object's closing brace.
        safe = body[self.args_at:].rstrip(" \t\r\n}")
        if len(safe) > self.sent_args:
            out.append({"index": len(self.calls) - 1, "function": {"arguments": safe[self.sent_args:]}})
            self.sent_args = len(safe)
        return out

    def _first_delta(self) -> dict:
        c = self.calls[-1]
        return {"index": len(self.calls) - 1, "id": c.id, "type": "function",
                "function": {"name": c.name, "arguments": ""}}

    def _close(self) -> tuple[str, list[dict]]:
        body, self.in_call = self.body, False
        started = self.args_at is not None
        call = _decode_call(body)
        if call is None:
            if not started:                   # not a call after all: it was text
                return self.p.start + body, []
            return "", []                     # a started call the model never finished: nothing more to add
        deltas = []
        if not started:
            self.calls.append(ToolCall(call.name, ""))
            self.args_at = 0
            deltas.append(self._first_delta())
            rest = call.arguments
        else:
            # What was streamed is a prefix of the arguments' own text: send the rest of that text.
            sent = body[self.args_at:self.args_at + self.sent_args]
            try:
                _, end = json.JSONDecoder().raw_decode(body, self.args_at + len(body[self.args_at:]) -
                                                       len(body[self.args_at:].lstrip()))
                raw = body[self.args_at:end].lstrip()
            except ValueError:
                raw = call.arguments
            rest = raw[len(sent):] if raw.startswith(sent) else ""
        self.calls[-1].arguments = (sent if started else "") + rest
        if rest:
            deltas.append({"index": len(self.calls) - 1, "function": {"arguments": rest}})
        return "", deltas


def merge_deltas(deltas: list[dict]) -> list[dict]:
    """One entry per call index (a first delta and an arguments fragment sent together)."""
    out: dict[int, dict] = {}
    for d in deltas:
        e = out.get(d["index"])
        if e is None:
            out[d["index"]] = {**d, "function": dict(d["function"])}
        else:
            e["function"]["arguments"] = e["function"].get("arguments", "") + d["function"].get("arguments", "")
    return list(out.values())


PARSERS = {"hermes": HermesToolParser}


def check_parser_name(name: str | None) -> None:
    """`--tool-call-parser` (vLLM's flag): None (choose by the template) or a registered name."""
    if name is not None and name not in PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}; known: {', '.join(sorted(PARSERS))}")


def parser_for(chat_template: str | None, name: str | None = None) -> HermesToolParser:
    """The parser `name` (--tool-call-parser), else the one for a model's chat template. Every family
    supported so far writes Hermes-style calls (and templates without a tool format get tokenfab's
    Hermes-style prompt), so the default is `hermes`; a new family adds its class to PARSERS (which
    makes it a valid --tool-call-parser value) and, to be chosen by default, a rule here."""
    check_parser_name(name)
    return PARSERS[name or "hermes"]()

"""Reasoning parsers (`--reasoning-parser`): a thinking model's text -> (reasoning, answer), whole or streamed.

Models such as DeepSeek-R1 and Qwen3 think before they answer, in the `<think>…</think>` convention:

    <think>
    The user wants ... so the answer is 4.
    </think>

    2 + 2 = 4.

The reasoning goes to `reasoning_content` (chat) or a `thinking` block (/v1/messages), the answer to
`content`, and only the answer reaches the tool-call parser (server/reply.py composes the two).

One parser per convention, chosen by name from `PARSERS`; a new convention is one subclass that sets
its tags and whether the output may begin inside the reasoning:
- `qwen3`: reasoning only after an opening `<think>` at the start of the output; a reply without one
  is all answer (Qwen3 with `enable_thinking: false`, or any model that does not think).
- `deepseek_r1`: the output starts inside the reasoning whether or not it opens with `<think>` (R1's
  chat templates put the tag in the prompt), as vLLM's parser assumes; a reply with no `</think>` is
  all reasoning.
Any parser also starts inside the reasoning when the prompt itself ends with the opening tag (a
template that opens the thinking for the model).

Streamed, a choice's text arrives in arbitrary pieces, so a tag may be split (`<thi` + `nk>`): the
stream holds back only a suffix that could still become the tag it waits for, and sends the rest at
once. The whitespace a model writes right after a tag separates it from the text and is dropped. A
reply cut off inside its reasoning (max_tokens) keeps what it had as reasoning, whole or streamed:
`split` is the stream fed in one piece, so the two always agree.
"""
from __future__ import annotations

from tokenfab.server.tool_parsers import partial_suffix


class ThinkTagParser:
    """The `<think>…</think>` convention; subclasses name themselves and say where the output starts."""
    name = "qwen3"
    start, end = "<think>", "</think>"
    starts_in_reasoning = False             # True: the output begins inside the reasoning, tag or no tag

    def starts_inside(self, prompt_tail: str) -> bool:
        """Whether a reply to a prompt ending in `prompt_tail` begins inside its reasoning."""
        return self.starts_in_reasoning or prompt_tail.rstrip().endswith(self.start)

    def streamer(self, inside: bool | None = None) -> "ReasoningStream":
        """`inside`: the output begins inside the reasoning (`starts_inside`); None: this parser's default."""
        return ReasoningStream(self, self.starts_in_reasoning if inside is None else inside)

    def split(self, text: str, inside: bool | None = None) -> tuple[str | None, str]:
        """(the reasoning, or None when the reply has none; the answer) of a whole reply."""
        s = self.streamer(inside)
        r1, a1 = s.feed(text)
        r2, a2 = s.finish()
        return (r1 + r2) or None, a1 + a2


class Qwen3ReasoningParser(ThinkTagParser):
    name = "qwen3"


class DeepSeekR1ReasoningParser(ThinkTagParser):
    name = "deepseek_r1"
    starts_in_reasoning = True


_OPENING, _REASONING, _ANSWER = "opening", "reasoning", "answer"


class ReasoningStream:
    """Incremental split of one choice's text. `feed(piece)` and finally `finish()` each return
    (reasoning to send, answer to send)."""

    def __init__(self, parser: ThinkTagParser, inside: bool) -> None:
        self.p = parser
        self.inside = inside                 # no opening tag: the text starts inside the reasoning
        self.state = _OPENING
        self.buf = ""                        # text held back: a possible tag prefix
        self.skip_space = True               # at the start of a section: leading whitespace is dropped

    def feed(self, text: str) -> tuple[str, str]:
        self.buf += text
        reasoning, answer = "", ""
        if self.state == _OPENING:
            head = self.buf.lstrip()
            if len(head) < len(self.p.start) and self.p.start.startswith(head):
                return "", ""                # still possibly the opening tag: wait
            if head.startswith(self.p.start):
                self.buf = head[len(self.p.start):]
                self._enter(_REASONING)
            else:
                self.state = _REASONING if self.inside else _ANSWER
        if self.state == _REASONING:
            i = self.buf.find(self.p.end)
            if i < 0:
                keep = partial_suffix(self.buf, self.p.end)
                reasoning, self.buf = self._section(self.buf[:len(self.buf) - keep]), self.buf[len(self.buf) - keep:]
                return reasoning, ""
            reasoning, self.buf = self._section(self.buf[:i]), self.buf[i + len(self.p.end):]
            self._enter(_ANSWER)
        answer, self.buf = self._section(self.buf), ""
        return reasoning, answer

    def finish(self) -> tuple[str, str]:
        """What was held back, once the reply has ended (a held tag prefix is text after all)."""
        rest, self.buf = self.buf, ""
        if self.state == _OPENING:
            self.state = _REASONING if self.inside else _ANSWER
        text = self._section(rest)
        return (text, "") if self.state == _REASONING else ("", text)

    def _enter(self, state: str) -> None:
        self.state, self.skip_space = state, True

    def _section(self, text: str) -> str:
        if self.skip_space:
            text = text.lstrip()
            self.skip_space = not text
        return text


PARSERS: dict[str, type[ThinkTagParser]] = {p.name: p for p in (Qwen3ReasoningParser, DeepSeekR1ReasoningParser)}


def check_parser_name(name: str | None) -> None:
    """`--reasoning-parser` (vLLM's flag): None (no reasoning split) or a registered name."""
    if name is not None and name not in PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}; known: {', '.join(sorted(PARSERS))}")


def parser_for(name: str | None) -> ThinkTagParser | None:
    check_parser_name(name)
    return PARSERS[name]() if name else None

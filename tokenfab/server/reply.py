"""A choice's generated text -> what a chat reply carries: reasoning, answer content, tool calls.

The one place the output parsers are composed, whole (`Reply.message`) and streamed (`Reply.stream`),
for /v1/chat/completions and /v1/messages alike (messages_reply.py turns the same pieces into content
blocks): the reasoning parser (server/reasoning.py) splits the reasoning off first, and only the answer
goes on to the tool-call parser (server/tools.py), so a `<tool_call>` the model writes while thinking
is never called.
"""
from __future__ import annotations

from dataclasses import dataclass

from tokenfab.server.reasoning import ReasoningStream, ThinkTagParser
from tokenfab.server.tools import ToolPlan, assistant_message, stream_delta


@dataclass(slots=True)
class Reply:
    """How a request's output is read: its tool plan and reasoning parser (each None when off).
    `inside`: the output begins inside the reasoning (the prompt opened it; reasoning.py)."""
    tools: ToolPlan | None = None
    reasoning: ThinkTagParser | None = None
    inside: bool | None = None

    def message(self, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        """The non-streamed choice's message and finish_reason; `reasoning_content` is present when a
        reasoning parser is on (None when the reply has no reasoning)."""
        if self.reasoning is None:
            return assistant_message(self.tools, text, finish_reason)
        reasoning, answer = self.reasoning.split(text, self.inside)
        message, finish_reason = assistant_message(self.tools, answer, finish_reason)
        if reasoning is not None and not message["content"]:
            message["content"] = None
        return {**message, "reasoning_content": reasoning}, finish_reason

    def stream(self) -> "ReplyStream":
        return ReplyStream(self)


class ReplyStream:
    """One choice's streamed text -> chat delta bodies ({"reasoning_content", "content", "tool_calls"})."""

    def __init__(self, reply: Reply) -> None:
        self.reasoning: ReasoningStream | None = reply.reasoning.streamer(reply.inside) if reply.reasoning else None
        tools = reply.tools
        self.calls = tools.parser.streamer() if tools is not None and tools.parses else None

    def feed(self, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        """(the delta body to send, which may be empty; the finish reason) for the next piece of text."""
        reasoning, answer = "", text
        if self.reasoning is not None:
            reasoning, answer = self.reasoning.feed(text)
            if finish_reason is not None:
                more, rest = self.reasoning.finish()
                reasoning, answer = reasoning + more, answer + rest
        body = {"reasoning_content": reasoning} if reasoning else {}
        if self.calls is not None:     # tool calls: text inside <tool_call> tags leaves as tool_calls deltas
            delta, finish_reason = stream_delta(self.calls, answer, finish_reason)
            body.update(delta)
        elif answer:
            body["content"] = answer
        return body, finish_reason

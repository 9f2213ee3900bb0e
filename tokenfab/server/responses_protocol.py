"""The OpenAI Responses API's request body (POST /v1/responses) as a pydantic model.

Types are strict, as in protocol.py, and unknown top-level fields are a 400 ("... is not a known
field"), as on /v1/messages: the Responses API grows features (`conversation`, `context_management`,
built-in tools) that change what a reply means, and a client that sends one must hear that it was not
honoured. The fields OpenAI defines that tokenfab cannot honour are declared (so they parse) and refused
by `unsupported()` with the reason the 400 gives. Input items, tools and `text.format` stay plain dicts
here: server/responses.py checks each and names the one at fault (`input[2].content[0].type`).
"""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

# Fields of OpenAI's request that tokenfab knows and cannot honour: (field) -> why. A field given as
# null counts as absent.
UNSUPPORTED = {
    "conversation": "conversations are not supported; chain responses with previous_response_id",
    "prompt": "stored prompt templates are not supported; send the input itself",
    "context_management": "context management (compaction) is not supported",
    "max_tool_calls": "max_tool_calls limits built-in tool calls, which tokenfab does not run",
    "moderation": "moderation is not supported",
    "background_options": "background mode is not supported",
    "access_programs": "access programs are not supported",
    "image": "image inputs are not supported",
    "prompt_cache_options": "prompt_cache_options is not supported; tokenfab caches prompt prefixes by itself",
}
# `include` values tokenfab honours: the output text's logprobs (with top_logprobs).
INCLUDABLE = ("message.output_text.logprobs",)
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")


class ResponsesRequest(BaseModel):
    """The body of POST /v1/responses."""
    model_config = ConfigDict(strict=True, extra="forbid")

    model: str | None = None
    input: str | list[dict] = Field(json_schema_extra={"anyOf": [   # what server/responses.py reads, for /openapi.json
        {"type": "string"}, {"type": "array", "items": {"type": "object"}}]})
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool | None = None               # None: true, as OpenAI's default
    metadata: dict[str, str] | None = None
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = None
    include: list[str] | None = None
    text: dict | None = None                # {"format": {...}, "verbosity": ...}
    reasoning: dict | None = None           # {"effort": ..., "summary": ...}
    truncation: str | None = None           # "disabled" only
    background: bool | None = None          # false only
    stream: bool | None = None
    stream_options: dict | None = None      # {"include_obfuscation": ...}: tokenfab pads no events
    service_tier: str | None = None         # as chat's: auto, default, flex (engine/lanes.py)
    user: str | None = None
    safety_identifier: str | None = None    # an end-user id for abuse tracking: accepted, not used
    prompt_cache_key: str | None = None     # a routing hint: tokenfab caches prompt prefixes by itself
    prompt_cache_retention: str | None = None
    conversation: Any = None
    prompt: Any = None
    context_management: Any = None
    max_tool_calls: Any = None
    moderation: Any = None
    background_options: Any = None
    access_programs: Any = None
    image: Any = None
    prompt_cache_options: Any = None

    def unsupported(self, reasoning: bool = False) -> tuple[str, str] | None:
        """(field, why) for the first field given that tokenfab cannot honour, else None. `reasoning`:
        the server runs a reasoning parser, so a reasoning effort other than none can be honoured."""
        for name in UNSUPPORTED:
            if getattr(self, name) is not None:
                return name, UNSUPPORTED[name]
        if self.background:
            return "background", "background mode is not supported; send background: false or leave it out"
        if self.truncation not in (None, "disabled"):
            return "truncation", (f"truncation {self.truncation!r} is not supported: tokenfab never drops input "
                                  "items; send \"disabled\" (a prompt over max_model_len is a 400)")
        for i, value in enumerate(self.include or ()):
            if value not in INCLUDABLE:
                return f"include[{i}]", (f"include {value!r} is not supported; tokenfab can include "
                                         f"{', '.join(INCLUDABLE)}")
        if self.top_logprobs is not None and "message.output_text.logprobs" not in (self.include or ()):
            return "top_logprobs", "top_logprobs needs include: [\"message.output_text.logprobs\"]"
        return self._unsupported_reasoning(reasoning) or self._unsupported_text()

    def _unsupported_reasoning(self, reasoning: bool) -> tuple[str, str] | None:
        r = self.reasoning or {}
        extra = sorted(k for k, v in r.items() if k not in ("effort", "summary", "generate_summary") and v is not None)
        if extra:
            return f"reasoning.{extra[0]}", "is not a known field"
        effort = r.get("effort")
        if effort is not None and effort not in REASONING_EFFORTS:
            return "reasoning.effort", f"effort {effort!r} is not one of {', '.join(REASONING_EFFORTS)}"
        if effort not in (None, "none") and not reasoning:
            return "reasoning.effort", (f"effort {effort!r} needs a server started with --reasoning-parser (this one "
                                        "splits no reasoning out); leave it out or send \"none\"")
        for key in ("summary", "generate_summary"):
            if r.get(key) is not None:
                return f"reasoning.{key}", ("reasoning summaries are not supported: the reasoning comes back as "
                                            "the model wrote it, in a reasoning item's content")
        return None

    def _unsupported_text(self) -> tuple[str, str] | None:
        t = self.text or {}
        extra = sorted(k for k, v in t.items() if k not in ("format", "verbosity") and v is not None)
        if extra:
            return f"text.{extra[0]}", "is not a known field"
        if t.get("verbosity") not in (None, "medium"):
            return "text.verbosity", "verbosity is not supported (the model writes as long as it writes)"
        return None

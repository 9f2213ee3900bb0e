"""The Anthropic Messages API's request bodies (/v1/messages, /v1/messages/count_tokens) as pydantic models.

Types are strict, as in protocol.py. Unlike the OpenAI bodies, unknown top-level fields are a 400
("... is not a known field"): Anthropic's API grows features (`thinking`, `container`, `mcp_servers`)
that change what a reply means, and a client that sends one must hear that it was not honoured. The
fields Anthropic defines that tokenfab cannot honour are declared (so they parse) and refused by
`unsupported()` with the reason the 400 gives. Content blocks stay plain dicts here: server/messages.py
checks each block's type and fields and names the one at fault (`messages[2].content[0].type`), which
a pydantic union cannot do clearly.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

# Fields of Anthropic's request that tokenfab knows and cannot honour: (field) -> why.
UNSUPPORTED = {
    "container": "code-execution containers are not supported",
    "mcp_servers": "MCP servers are not supported; pass the tools in `tools`",
    "context_management": "context management is not supported",
    "service_tier": "service tiers are not supported on /v1/messages",
    "output_config": "output_config (effort, output format) is not supported on /v1/messages",
}


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class ToolParam(_Body):
    """A client tool. `type` is absent or "custom"; Anthropic's server tools (web search, ...) have
    their own types and are refused by server/messages.py."""
    name: str
    input_schema: dict
    description: str | None = None
    type: str | None = None
    cache_control: dict | None = None       # a prompt-caching hint: tokenfab caches prefixes by itself


class MessageParam(_Body):
    role: Literal["user", "assistant"]
    content: str | list[dict]


class CountTokensRequest(_Body):
    """The body of /v1/messages/count_tokens, and the prompt half of a /v1/messages body."""
    model: str
    messages: list[MessageParam] = Field(min_length=1)
    system: str | list[dict] | None = None
    tools: list[ToolParam] | None = None
    tool_choice: dict | None = None
    thinking: dict | None = None            # disabled; enabled only with --reasoning-parser (server/messages.py)
    cache_control: dict | None = None       # a prompt-caching hint: tokenfab caches prefixes by itself
    container: Any = None
    mcp_servers: Any = None
    context_management: Any = None
    output_config: Any = None
    # aliased: ServerState's API-key check reads `service_tier` as OpenAI's (with `priority`)
    tier: Any = Field(None, alias="service_tier")

    def unsupported(self, reasoning: bool = False) -> tuple[str, str] | None:
        """(field, why) for the first field given that tokenfab cannot honour, else None. `reasoning`:
        the server runs a reasoning parser, so `thinking: {"type": "enabled"}` can be honoured."""
        for name, field in type(self).model_fields.items():
            key = field.alias or name
            if key in UNSUPPORTED and getattr(self, name) is not None:
                return key, UNSUPPORTED[key]
        thinking = (self.thinking or {}).get("type", "disabled")
        if thinking == "enabled" and not reasoning:
            return "thinking", ("type 'enabled' needs a server started with --reasoning-parser (this one splits "
                                'no reasoning out); leave it out or send {"type": "disabled"}')
        if thinking not in ("disabled", "enabled"):
            return "thinking", f'type {thinking!r} is not supported; send {{"type": "enabled"}} or {{"type": "disabled"}}'
        return None


class MessagesRequest(CountTokensRequest):
    """The body of POST /v1/messages."""
    max_tokens: int
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    metadata: dict[str, Any] | None = None  # {"user_id": ...}: accepted, not used
    stream: bool = False

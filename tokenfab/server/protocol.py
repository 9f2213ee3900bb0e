"""The OpenAI request bodies as pydantic models (the fields vLLM accepts, where we support them).

Types are strict (`"5"` is not an int) so a wrong type is a 400 naming the field. Unknown fields are
accepted and ignored (clients such as LangChain send extras), and logged once by the server. Fields we
know but cannot honour (`suffix`, ...) are rejected with a 400 rather than
silently ignored. Responses are plain dicts built by the route modules (cheaper per SSE chunk).
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from tokenfab.engine.lanes import SERVICE_TIERS

Role = Literal["system", "user", "assistant", "tool", "developer"]


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False   # usage on every chunk (vLLM's extension; `bench` uses it)


class SamplingFields(_Body):
    """Fields shared by completions and chat. None means the default."""
    model: str | None = None
    n: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: Any = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    priority: int = 0
    service_tier: str | None = None         # default: interactive; flex: batch; auto/none: by priority (engine/lanes.py)
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    best_of: int | None = None
    # vLLM's structured-output extras (server/structured.py turns them into StructuredOutputParams)
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    speculative: bool = True                # False: this request never drafts (when the server speculates)

    @field_validator("service_tier")
    @classmethod
    def _service_tier(cls, v):
        if v is not None and v not in SERVICE_TIERS:
            raise ValueError("service_tier must be \"auto\", \"default\" or \"flex\"")
        return v

    @property
    def service_class(self) -> str:
        return SERVICE_TIERS[self.service_tier]

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        if v is None or isinstance(v, str) or (isinstance(v, list) and all(isinstance(s, str) for s in v)):
            return v
        raise ValueError("stop must be a string or a list of strings")

    def unsupported(self) -> tuple[str, str] | None:
        """(field, why) for a field we know but cannot honour, else None."""
        if self.best_of is not None and self.best_of != (self.n or 1):
            return "best_of", "best_of is not supported (use n)"
        return None

    def sampling_kwargs(self) -> dict:
        """SamplingParams keyword arguments for the fields that were given."""
        kw = {k: getattr(self, k) for k in ("n", "temperature", "top_p", "top_k", "min_p", "presence_penalty",
                                            "frequency_penalty", "repetition_penalty", "min_tokens", "seed")
              if getattr(self, k) is not None}
        if self.stop is not None:
            kw["stop"] = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        if self.stop_token_ids:
            kw["stop_token_ids"] = list(self.stop_token_ids)
        kw.update(ignore_eos=self.ignore_eos, include_stop_str_in_output=self.include_stop_str_in_output,
                  skip_special_tokens=self.skip_special_tokens, speculative=self.speculative)
        return kw

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and (self.stream_options.include_usage
                                             or self.stream_options.continuous_usage_stats))

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)


class CompletionRequest(SamplingFields):
    prompt: Any = Field(json_schema_extra={"anyOf": [    # what _prompt accepts, for /openapi.json
        {"type": "string"}, {"type": "array", "items": {"type": "string"}, "minItems": 1},
        {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1},
        {"type": "array", "items": {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1},
         "minItems": 1}]})
    max_tokens: int | None = 16             # OpenAI's default for completions
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v):
        def ids(x) -> bool:
            return isinstance(x, list) and bool(x) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)
        if isinstance(v, str) or ids(v):
            return v
        if isinstance(v, list) and v and (all(isinstance(p, str) for p in v) or all(ids(p) for p in v)):
            return v
        raise ValueError("prompt must be a string, a list of strings, a list of token ids, "
                         "or a list of token-id lists (none of them empty)")

    def prompts(self) -> list[str | list[int]]:
        """The prompt as a list of prompts (a batch of one when a single prompt was given)."""
        v = self.prompt
        if isinstance(v, str) or isinstance(v[0], int):
            return [v]
        return list(v)


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: Role
    content: Any = Field(None, json_schema_extra={"anyOf": [     # what _content accepts, for /openapi.json
        {"type": "string"}, {"type": "null"},
        {"type": "array", "items": {"type": "object", "required": ["type", "text"],
                                    "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}}]})
    name: str | None = None
    tool_calls: list[dict] | None = None     # an assistant's earlier calls (server/tools.py renders them)
    tool_call_id: str | None = None          # a tool message: which call this is the result of

    @field_validator("content")
    @classmethod
    def _content(cls, v):
        if v is None or isinstance(v, str):
            return v
        if isinstance(v, list):
            parts = []
            for i, p in enumerate(v):
                if not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str):
                    raise ValueError(f"content[{i}] must be {{\"type\": \"text\", \"text\": ...}}; "
                                     "only text content is supported")
                parts.append(p["text"])
            return "\n".join(parts)
        raise ValueError("content must be a string or a list of text parts")

    def as_template_input(self) -> dict:
        msg = {"role": self.role, "content": self.content or ""}
        if self.name:
            msg["name"] = self.name
        if self.tool_calls:
            msg["tool_calls"] = self.tool_calls
        if self.tool_call_id is not None:
            msg["tool_call_id"] = self.tool_call_id
        return msg


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    max_tokens: int | None = None           # the older name; max_completion_tokens wins when both are given
    logprobs: bool = False
    top_logprobs: int | None = None
    response_format: dict | None = None
    tools: list | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool = True
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None   # template variables, e.g. {"enable_thinking": false}

    @field_validator("messages")
    @classmethod
    def _messages(cls, v):
        if not v:
            raise ValueError("messages must be a non-empty list of {role, content} objects")
        return v

    def unsupported(self) -> tuple[str, str] | None:
        return super().unsupported()

    @property
    def requested_max_tokens(self) -> tuple[int | None, str]:
        """(value, the field it came from)."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]

"""StructuredOutputParams: what a request's output must match (a JSON schema, any JSON object, a regex,
one of a list of strings, or a grammar), with vLLM's names.

    SamplingParams(structured_output=StructuredOutputParams(json={"type": "object", ...}))

Exactly one kind is set. The shape is checked here, at the boundary; whether the schema or grammar
compiles is checked by the engine's grammar compiler (tokenfab/engine/structured.py) when the request
is added, so an uncompilable spec is a ValueError before anything is queued.
"""
from __future__ import annotations

import json as _json
from dataclasses import dataclass

KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True, slots=True)
class StructuredOutputParams:
    json: dict | str | None = None          # a JSON schema (an object, or its JSON text)
    json_object: bool = False               # any JSON object (OpenAI's response_format json_object)
    regex: str | None = None                # the whole output matches this regex
    choice: tuple[str, ...] | None = None   # the output is exactly one of these strings
    grammar: str | None = None              # a context-free grammar: GBNF (llama.cpp's EBNF) or Lark

    def __post_init__(self) -> None:
        if isinstance(self.choice, list):
            object.__setattr__(self, "choice", tuple(self.choice))
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured_output needs exactly one of {', '.join(KINDS)}; got "
                             f"{', '.join(given) or 'none'}")
        if self.json is not None:
            schema = self.json
            if isinstance(schema, str):
                try:
                    schema = _json.loads(schema)
                except ValueError as e:
                    raise ValueError(f"structured_output.json is not valid JSON: {e}") from None
            if not isinstance(schema, (dict, bool)):
                raise ValueError(f"structured_output.json must be a JSON schema object, got {type(schema).__name__}")
        if not isinstance(self.json_object, bool):
            raise ValueError("structured_output.json_object must be true or false")
        for name in ("regex", "grammar"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                raise ValueError(f"structured_output.{name} must be a non-empty string")
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) and c for c in self.choice)):
            raise ValueError("structured_output.choice must be a non-empty list of non-empty strings")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def key(self) -> tuple[str, str]:
        """(kind, canonical text): equal specs give equal keys (the grammar cache's key)."""
        k = self.kind
        if k == "json":
            v = self.json if not isinstance(self.json, str) else _json.loads(self.json)
            return k, _json.dumps(v, sort_keys=True, separators=(",", ":"))
        if k == "json_object":
            return k, ""
        if k == "choice":
            return k, _json.dumps(list(self.choice))
        return k, getattr(self, k)

    @classmethod
    def coerce(cls, v) -> "StructuredOutputParams | None":
        """None, an instance, or a dict of its fields (e.g. {"json": {...}})."""
        if v is None or isinstance(v, cls):
            return v
        if isinstance(v, dict):
            unknown = sorted(set(v) - set(KINDS))
            if unknown:
                raise ValueError(f"structured_output has unknown field(s) {unknown}; known: {list(KINDS)}")
            return cls(**v)
        raise ValueError(f"structured_output must be a StructuredOutputParams or a dict, got {type(v).__name__}")

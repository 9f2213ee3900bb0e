"""Structured output over HTTP: OpenAI's `response_format` and vLLM's `guided_*` extras -> one
StructuredOutputParams, compiled before the request is queued so a bad schema is a 400 naming the
field, never a 500.

    response_format {"type": "json_object"}                        any JSON object (chat)
    response_format {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}   (chat)
    guided_json (a schema) | guided_regex | guided_choice | guided_grammar (GBNF or Lark)  (both endpoints)
"""
from __future__ import annotations

import asyncio

from tokenfab.server.errors import APIError
from tokenfab.structured_output import StructuredOutputParams

GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def requested_structure(req) -> tuple[StructuredOutputParams | None, str | None]:
    """(the spec, the request field it came from), or (None, None). 400 on a malformed field."""
    found: list[tuple[str, dict]] = []
    rf = getattr(req, "response_format", None)
    if rf is not None:
        kind = rf.get("type", "text") if isinstance(rf, dict) else None
        if kind == "json_object":
            found.append(("response_format", {"json_object": True}))
        elif kind == "json_schema":
            js = rf.get("json_schema")
            if not isinstance(js, dict):
                raise APIError(400, "response_format json_schema needs a \"json_schema\" object "
                               "({\"name\": ..., \"schema\": {...}})", param="response_format.json_schema",
                               code="invalid_value")
            schema = js.get("schema", {"type": "object"})     # OpenAI: no schema means any JSON object
            if not isinstance(schema, dict):
                raise APIError(400, "response_format.json_schema.schema must be a JSON schema object",
                               param="response_format.json_schema.schema", code="invalid_value")
            found.append(("response_format", {"json": schema}))
        elif kind != "text":
            raise APIError(400, f"response_format type {kind!r} is not one of text, json_object, json_schema",
                           param="response_format.type", code="invalid_value")
    for field, kind in GUIDED.items():
        v = getattr(req, field, None)
        if v is not None:
            found.append((field, {kind: v}))
    if not found:
        return None, None
    if len(found) > 1:
        raise APIError(400, f"give one structured-output constraint, not {' and '.join(f for f, _ in found)}",
                       param=found[1][0], code="invalid_value")
    field, kw = found[0]
    try:
        return StructuredOutputParams(**kw), field
    except ValueError as e:
        msg = str(e).replace("structured_output." + next(iter(kw)), field)
        raise APIError(400, msg, param=field, code="invalid_value") from None


async def check_compiles(client, spec: StructuredOutputParams, param: str) -> None:
    """Compile `spec` now (off the event loop; the result stays in the engine's cache for add_request).
    `client`: the EngineClient (engine/client.py)."""
    try:
        await asyncio.to_thread(client.compile_structured, spec)
    except ValueError as e:
        raise APIError(400, f"{param}: {e}", param=param, code="invalid_value") from None

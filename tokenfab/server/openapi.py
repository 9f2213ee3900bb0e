"""/openapi.json: every route with its request body, its responses and their schemas.

The generation routes parse their bodies themselves (`ServerState.parse`: exact 400s naming the field,
unknown fields logged), so FastAPI cannot see their request models, and their handlers return plain
dicts (cheaper per SSE chunk). This module tells the spec what they take and give: the request models
of protocol.py, and the response models below, which describe the dicts the routes build. The fuzz
test (tests/test_server_fuzz.py) holds the routes to them: no 5xx, no response outside its schema.
"""
from __future__ import annotations

from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict
from pydantic.json_schema import models_json_schema

from tokenfab.server.errors import anthropic_path
from tokenfab.server.messages_protocol import CountTokensRequest, MessagesRequest
from tokenfab.server.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from tokenfab.server.responses_protocol import ResponsesRequest


class _Out(BaseModel):
    model_config = ConfigDict(extra="allow")     # a response may grow fields; clients ignore extras


class ErrorDetail(_Out):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(_Out):
    error: ErrorDetail


class Usage(_Out):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(_Out):
    tokens: list[str]
    token_logprobs: list[float | None]          # null for the first prompt token under echo
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(_Out):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | None = None


class CompletionResponse(_Out):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class TopLogprob(_Out):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TopLogprob):
    logprob: float | None
    top_logprobs: list[TopLogprob]


class ChatLogprobs(_Out):
    content: list[ChatTokenLogprob]


class ChatMessageOut(_Out):
    role: Literal["assistant"]
    content: str | None


class ChatChoice(_Out):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | None = None


class ChatCompletionResponse(_Out):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ModelCard(_Out):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str | None = None
    max_model_len: int


class ModelList(_Out):
    object: Literal["list"]
    data: list[ModelCard]


class TokenizeResponse(_Out):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(_Out):
    prompt: str


class TokenizerInfoResponse(_Out):
    tokenizer_class: str
    eos_token: str | None
    bos_token: str | None
    pad_token: str | None
    chat_template: str | None
    model_max_length: int


class AnthropicErrorDetail(_Out):
    type: str
    message: str


class AnthropicErrorResponse(_Out):
    """Errors on the Messages API's paths (server/errors.py anthropic_error_body)."""
    type: Literal["error"]
    error: AnthropicErrorDetail


class ContentBlockOut(_Out):
    type: Literal["text", "tool_use"]


class MessageUsage(_Out):
    input_tokens: int
    output_tokens: int


class MessageResponse(_Out):
    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    model: str
    content: list[ContentBlockOut]
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]
    stop_sequence: str | None
    usage: MessageUsage


class TokenCountResponse(_Out):
    input_tokens: int


class OutputItem(_Out):
    id: str
    type: Literal["message", "function_call", "reasoning"]


class InputItem(_Out):
    id: str
    type: Literal["message", "function_call", "function_call_output", "reasoning"]


class ResponseUsage(_Out):
    input_tokens: int
    output_tokens: int
    total_tokens: int


class ResponseObject(_Out):
    """/v1/responses (server/responses.py): a response, as created, streamed at the end, or stored."""
    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["completed", "incomplete", "in_progress"]
    model: str
    output: list[OutputItem]
    usage: ResponseUsage | None
    previous_response_id: str | None
    store: bool


class ResponseDeleted(_Out):
    id: str
    object: Literal["response.deleted"]
    deleted: bool


class InputItemList(_Out):
    object: Literal["list"]
    data: list[InputItem]
    first_id: str | None
    last_id: str | None
    has_more: bool


class HealthResponse(_Out):
    status: str


class VersionResponse(_Out):
    version: str


# One server-sent event (the shape OpenAPI 3.2's itemSchema gives events; schemathesis checks each).
_SSE = {"text/event-stream": {"schema": {
    "type": "object", "required": ["data"],
    "properties": {"data": {"type": "string", "description": "a JSON chunk (chat.completion.chunk or "
                            "text_completion), an {\"error\": ...} object, or [DONE] at the end; on "
                            "/v1/responses, one of the Responses API's typed events, and on /v1/messages one of "
                            "Anthropic's, each after its event: line"}}}}}
# (path, method) -> (request model or None, 200 response model or "text", streamed?, error statuses)
_GENERATION_ERRORS = (400, 401, 404, 413, 429, 500, 503)
ROUTES: dict[tuple[str, str], tuple[type[BaseModel] | None, type[BaseModel] | str, bool, tuple[int, ...]]] = {
    ("/v1/completions", "post"): (CompletionRequest, CompletionResponse, True, _GENERATION_ERRORS),
    ("/v1/chat/completions", "post"): (ChatCompletionRequest, ChatCompletionResponse, True, _GENERATION_ERRORS),
    ("/v1/responses", "post"): (ResponsesRequest, ResponseObject, True, _GENERATION_ERRORS + (403,)),
    ("/v1/responses/{response_id}", "get"): (None, ResponseObject, False, (401, 404)),
    ("/v1/responses/{response_id}", "delete"): (None, ResponseDeleted, False, (401, 404)),
    ("/v1/responses/{response_id}/input_items", "get"): (None, InputItemList, False, (400, 401, 404)),
    ("/v1/messages", "post"): (MessagesRequest, MessageResponse, True, _GENERATION_ERRORS + (403,)),
    ("/v1/messages/count_tokens", "post"): (CountTokensRequest, TokenCountResponse, False, (400, 401, 403, 404, 413)),
    ("/tokenize", "post"): (TokenizeRequest, TokenizeResponse, False, (400, 401, 404, 413)),
    ("/detokenize", "post"): (DetokenizeRequest, DetokenizeResponse, False, (400, 401, 404, 413)),
    ("/tokenizer_info", "get"): (None, TokenizerInfoResponse, False, (401,)),
    ("/v1/models", "get"): (None, ModelList, False, (401,)),
    ("/v1/models/{model_id}", "get"): (None, ModelCard, False, (401, 404)),
    ("/health", "get"): (None, HealthResponse, False, (503,)),
    ("/version", "get"): (None, VersionResponse, False, ()),
    ("/metrics", "get"): (None, "text", False, ()),
}
_REF = "#/components/schemas/{model}"


def build_openapi(app: FastAPI) -> dict[str, Any]:
    spec = get_openapi(title=app.title, version=app.version, routes=app.routes,
                       description="tokenfab's OpenAI-compatible API (completions, chat) and vLLM's extras.")
    models = [ErrorResponse, AnthropicErrorResponse] + [m for req, resp, _, _ in ROUTES.values()
                                for m in (req, resp) if isinstance(m, type)]
    _, defs = models_json_schema([(m, "validation") for m in dict.fromkeys(models)], ref_template=_REF)
    schemas = spec.setdefault("components", {}).setdefault("schemas", {})
    schemas.update(defs.get("$defs", {}))
    for unused in ("HTTPValidationError", "ValidationError"):   # FastAPI's 422, which no route answers
        schemas.pop(unused, None)
    for path, ops in spec.get("paths", {}).items():
        for method, op in ops.items():
            if method == "head":       # below, from its GET
                continue
            entry = ROUTES.get((path, method))
            if entry is None:      # a route FastAPI describes itself (Batch API, /doctor): our errors, not its 422
                op.setdefault("responses", {}).pop("422", None)
                _add_errors(op, _OTHER_ERRORS)
                continue
            req, resp, streamed, errors = entry
            if req is not None:
                op["requestBody"] = {"required": True, "content": {
                    "application/json": {"schema": {"$ref": _REF.format(model=req.__name__)}}}}
            if resp == "text":
                ok = {"text/plain": {"schema": {"type": "string"}}}
            else:
                ok = {"application/json": {"schema": {"$ref": _REF.format(model=resp.__name__)}}}
            if streamed:
                ok |= _SSE
            op["responses"] = {"200": {"description": "success" + (" (text/event-stream when stream is true)"
                                                                   if streamed else ""), "content": ok}}
            _add_errors(op, errors, "AnthropicErrorResponse" if anthropic_path(path) else "ErrorResponse")
    # HEAD answers like GET, with the headers only: the GET's statuses, no bodies.
    for ops in spec.get("paths", {}).values():
        if "head" in ops and "get" in ops:
            ops["head"]["responses"] = {k: {"description": v["description"]} for k, v in ops["get"]["responses"].items()}
    return spec


def _add_errors(op: dict[str, Any], statuses: tuple[int, ...], model: str = "ErrorResponse") -> None:
    for status in statuses:
        op["responses"][str(status)] = {"description": _ERROR_TEXT[status], "content": {
            "application/json": {"schema": {"$ref": _REF.format(model=model)}}}}


# What the routes outside ROUTES may answer besides 200: bad input, no key, unknown id, too large, failed.
_OTHER_ERRORS = (400, 401, 404, 413, 500, 503)
_ERROR_TEXT = {400: "invalid request (the error names the field: param, and a machine-readable code)",
               401: "missing or wrong API key (servers started with --api-key)",
               403: "the API key may not use this model (--api-keys-file)",
               404: "unknown model, file, batch or stored response", 413: "request body or file over its size limit",
               429: "too many requests waiting (Retry-After)", 500: "the request failed inside the engine",
               503: "the engine has stopped or the server is shutting down"}


def install_openapi(app: FastAPI) -> None:
    """Serve the spec at /openapi.json (built once, on first request)."""
    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = build_openapi(app)
        return app.openapi_schema

    async def serve(_: Request) -> JSONResponse:
        return JSONResponse(app.openapi())

    app.openapi = openapi
    app.add_route("/openapi.json", serve, methods=["GET", "HEAD"], include_in_schema=False)

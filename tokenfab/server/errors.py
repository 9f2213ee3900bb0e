"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}`` with the right status,
and on the Anthropic Messages API's paths (/v1/messages...) in Anthropic's:
``{"type": "error", "error": {"type", "message"}}``.

Route code raises `APIError`; the handlers installed here turn it, FastAPI's validation errors,
unknown routes (404/405) and unexpected exceptions (500, logged, no traceback sent) into the body the
request's path calls for. The ASGI middlewares (auth, body size) build the same bodies with `error_bytes`.
"""
from __future__ import annotations

import json
import logging
import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("tokenfab.server")

# OpenAI's error types by status.
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error",
               429: "rate_limit_error", 500: "internal_error", 503: "service_unavailable"}
# The code a raise site that names none gets, so no error body carries "code": null.
DEFAULT_CODES = {400: "invalid_value", 401: "invalid_api_key", 403: "forbidden", 404: "not_found",
                 405: "method_not_allowed", 413: "request_too_large", 429: "rate_limited", 500: "internal_error",
                 503: "service_unavailable"}

# Anthropic's error types by status; any other 5xx is "api_error".
ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                   404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large",
                   429: "rate_limit_error", 529: "overloaded_error"}
ANTHROPIC_PATH = "/v1/messages"


def anthropic_path(path: str) -> bool:
    """Whether `path` belongs to the Anthropic Messages API (its errors take Anthropic's shape)."""
    return path == ANTHROPIC_PATH or path.startswith(ANTHROPIC_PATH + "/")


def anthropic_error_body(status: int, message: str) -> dict:
    kind = ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


class APIError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code or DEFAULT_CODES.get(status, "error")
        self.type = type or ERROR_TYPES.get(status, "invalid_request_error")
        self.headers = headers

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)

    def response(self, path: str = "") -> JSONResponse:
        """The error as the response to a request for `path` (Anthropic's shape on its paths)."""
        body = anthropic_error_body(self.status, self.message) if anthropic_path(path) else self.body()
        return JSONResponse(body, status_code=self.status, headers=self.headers)


MAX_JSON_DEPTH = 128      # nesting a body may have: far below Python's recursion limit, which every
                          # recursive step after parsing (validation, templates, grammars) shares


def _finite(text: str) -> float:
    v = float(text)
    if v in (float("inf"), float("-inf")):
        raise ValueError(f"the number {text[:40]} is beyond float64's range")
    return v


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def parse_json_object(raw: bytes) -> dict:
    """A request body as a JSON object, or an APIError 400 saying what is wrong with it: not UTF-8, not
    JSON (NaN and Infinity included, which Python's json reads), a number beyond float64 or longer than
    Python converts, nesting deeper than MAX_JSON_DEPTH, or not an object."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise APIError(400, f"the body is not valid UTF-8 (byte 0x{raw[e.start]:02x} at offset {e.start})",
                       code="invalid_encoding") from None
    try:
        obj = json.loads(text, parse_float=_finite, parse_constant=_no_constant)
    except json.JSONDecodeError as e:
        raise APIError(400, f"the body is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}",
                       code="invalid_json") from None
    except RecursionError:
        raise APIError(400, f"the body nests JSON deeper than {MAX_JSON_DEPTH} levels", code="invalid_json") from None
    except ValueError as e:     # _finite, _no_constant, or an integer longer than int() takes
        raise APIError(400, f"the body is not valid JSON: {str(e)[:200]}", code="invalid_json") from None
    if not isinstance(obj, dict):
        raise APIError(400, f"the body must be a JSON object, got {type(obj).__name__}", code="invalid_json")
    # a \uD800-\uDFFF escape that json.loads did not pair is a lone surrogate: no tokenizer encodes it
    surrogates = _SURROGATE_ESCAPE.search(text) is not None
    depth, level = 0, [obj]
    while level:              # breadth first: no recursion
        depth += 1
        if depth > MAX_JSON_DEPTH:
            raise APIError(400, f"the body nests JSON deeper than {MAX_JSON_DEPTH} levels", code="invalid_json")
        items = [x for o in level for x in ((*o.keys(), *o.values()) if isinstance(o, dict) else o)]
        if surrogates and any(isinstance(x, str) and _lone_surrogate(x) for x in items):
            raise APIError(400, "the body has a string with a lone UTF-16 surrogate (an unpaired \\uD800-\\uDFFF "
                                "escape): not Unicode text", code="invalid_encoding")
        level = [x for x in items if isinstance(x, (dict, list))]
    return obj


_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def _lone_surrogate(s: str) -> bool:
    try:
        s.encode("utf-8")
        return False
    except UnicodeEncodeError:
        return True


def renamed(e: APIError, renames: list[tuple[re.Pattern, str]]) -> APIError:
    """`e` with the field names in its message and param rewritten by `renames` ((pattern, replacement)
    pairs): a route that maps its body onto a chat request speaks of its own fields in its errors."""
    message, param = e.message, e.param
    for pattern, repl in renames:
        message = pattern.sub(repl, message)
        param = pattern.sub(repl, param) if param else param
    return APIError(e.status, message, param=param, code=e.code, type=e.type, headers=e.headers)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def error_bytes(status: int, message: str, param: str | None = None, code: str | None = None,
                path: str = "") -> bytes:
    if anthropic_path(path):
        return json.dumps(anthropic_error_body(status, message)).encode()
    return json.dumps(error_body(message, ERROR_TYPES.get(status, "invalid_request_error"), param,
                                 code or DEFAULT_CODES.get(status, "error"))).encode()


def loc_to_param(loc: tuple | list) -> str | None:
    """pydantic's ('messages', 1, 'role') -> 'messages[1].role'; the body root -> None."""
    out = ""
    for part in loc:
        if part == "body" and not out:
            continue
        if isinstance(part, int):
            out += f"[{part}]"
        elif isinstance(part, str) and "[" not in part and "function-after" not in part:
            out += ("." if out else "") + part
    return out or None


def from_validation_errors(errors: list[dict]) -> APIError:
    """The first pydantic error as a 400 naming its field (the rest are usually consequences)."""
    first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    param = loc_to_param(first.get("loc", ()))
    msg = first.get("msg", "invalid value")
    if first.get("type") == "json_invalid":
        return APIError(400, f"the body is not valid JSON: {msg}", code="invalid_json")
    if first.get("type") == "missing":
        return APIError(400, f"{param} is required", param=param, code="missing_field")
    if first.get("type") == "extra_forbidden":
        return APIError(400, f"{param} is not a known field", param=param, code="unknown_field")
    got = first.get("input")
    shown = "" if isinstance(got, (dict, list)) or got is None else f" (got {json.dumps(got)[:80]})"
    where = f"{param}: " if param else ""
    return APIError(400, f"{where}{msg}{shown}", param=param, code="invalid_value")


class ClientGone(Exception):
    """The client disconnected before its whole (not streamed) response was ready; its requests are aborted."""


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ClientGone)
    async def _client_gone(request: Request, exc: ClientGone) -> Response:
        access = getattr(request.state, "access", None)
        if access is not None:
            access["outcome"] = "client_disconnected"
        return Response(status_code=499)     # nginx's "client closed request": nobody reads it

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response(request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _request_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return from_validation_errors(list(exc.errors())).response(request.url.path)

    @app.exception_handler(ValidationError)
    async def _validation(request: Request, exc: ValidationError) -> JSONResponse:
        return from_validation_errors(exc.errors()).response(request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            err = APIError(404, f"no route {request.method} {request.url.path}; see /v1/models, /v1/completions, "
                                "/v1/chat/completions, /v1/responses, /v1/messages", code="route_not_found")
        elif exc.status_code == 405:
            err = APIError(405, f"{request.method} is not allowed on {request.url.path}",
                           code="method_not_allowed", headers=dict(exc.headers or {}))
        else:
            err = APIError(exc.status_code, str(exc.detail), headers=dict(exc.headers or {}) or None)
        return err.response(request.url.path)

    @app.exception_handler(RecursionError)
    async def _recursion(request: Request, exc: RecursionError) -> JSONResponse:
        # parse_json_object bounds the nesting; this catches what a deep value reaches past it
        log.warning("%s %s: %s", request.method, request.url.path, exc)
        return APIError(400, "a value in the request nests too deeply to process",
                        code="invalid_value").response(request.url.path)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.error("%s %s failed", request.method, request.url.path, exc_info=exc)
        return APIError(500, f"internal error ({type(exc).__name__}); the server log has details"
                        ).response(request.url.path)

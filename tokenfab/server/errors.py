"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}`` with the right status.

Route code raises `APIError`; the handlers installed here turn it, FastAPI's validation errors,
unknown routes (404/405) and unexpected exceptions (500, logged, no traceback sent) into that body.
The ASGI middlewares (auth, body size) build the same body with `error_body`.
"""
from __future__ import annotations

import json
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
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

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def error_bytes(status: int, message: str, param: str | None = None, code: str | None = None) -> bytes:
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


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _request_validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return from_validation_errors(list(exc.errors())).response()

    @app.exception_handler(ValidationError)
    async def _validation(_: Request, exc: ValidationError) -> JSONResponse:
        return from_validation_errors(exc.errors()).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            err = APIError(404, f"no route {request.method} {request.url.path}; see /v1/models, "
                                "/v1/completions, /v1/chat/completions", code="route_not_found")
        elif exc.status_code == 405:
            err = APIError(405, f"{request.method} is not allowed on {request.url.path}",
                           code="method_not_allowed", headers=dict(exc.headers or {}))
        else:
            err = APIError(exc.status_code, str(exc.detail), headers=dict(exc.headers or {}) or None)
        return err.response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.error("%s %s failed", request.method, request.url.path, exc_info=exc)
        return APIError(500, f"internal error ({type(exc).__name__}); the server log has details").response()

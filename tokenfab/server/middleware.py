"""Plain ASGI middlewares: access log, API-key check, body-size limit.

Plain ASGI rather than Starlette's BaseHTTPMiddleware, which buffers and wraps streaming responses
and can hide a client's disconnect from the SSE generator (the disconnect must abort the request).
Order, outside in: AccessLog -> APIKeyAuth -> BodySizeLimit -> the app.
"""
from __future__ import annotations

import hmac
import logging
import time

from tokenfab.server.errors import error_bytes
from tokenfab.server.keys import retry_after

access_log = logging.getLogger("tokenfab.access")

# Paths anyone may call: probes and scrapers must work without the key.
PUBLIC_PATHS = ("/health", "/metrics", "/version", "/")
# The web page's static files (server/ui.py): the page asks the user for the key, it holds none.
PUBLIC_PREFIXES = ("/ui/",)


async def send_error(send, scope, status: int, message: str, code: str | None = None,
                     headers: list[tuple[bytes, bytes]] = ()) -> None:
    """The error in the shape the request's path calls for (OpenAI's, or Anthropic's on /v1/messages)."""
    body = error_bytes(status, message, code=code, path=scope.get("path", ""))
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": body})


class AccessLog:
    """One line per request: client, method, path, status, id, prompt/output tokens, TTFT, total time.

    Route handlers put their request's fields in ``request.state.access`` (a dict in scope["state"])."""

    def __init__(self, app, enabled: bool = True) -> None:
        self.app, self.enabled = app, enabled

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not self.enabled:
            return await self.app(scope, receive, send)
        t0 = time.perf_counter()
        state = scope.setdefault("state", {})
        status = [0]

        async def send_wrapper(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        except BaseException:
            status[0] = status[0] or 500
            raise
        finally:
            self._log(scope, state.get("access") or {}, status[0], time.perf_counter() - t0)

    @staticmethod
    def _log(scope, fields: dict, status: int, total_s: float) -> None:
        client = scope.get("client")
        who = f"{client[0]}:{client[1]}" if client else "-"
        parts = [f'{who} "{scope["method"]} {scope["path"]}" {status or 499}']
        if "id" in fields:
            parts.append(f"id={fields['id']}")
        for key in ("prompt_tokens", "output_tokens"):
            if key in fields:
                parts.append(f"{key}={fields[key]}")
        if fields.get("ttft_s") is not None:
            parts.append(f"ttft_ms={fields['ttft_s'] * 1e3:.1f}")
        parts.append(f"total_ms={total_s * 1e3:.1f}")
        if fields.get("outcome"):
            parts.append(str(fields["outcome"]))
        access_log.info(" ".join(parts))


class APIKeyAuth:
    """`Authorization: Bearer KEY`, or Anthropic's `x-api-key: KEY` (which wins when both are sent), on every
    path but PUBLIC_PATHS (only /health with `all_routes`), compared in constant time; then the key's rate
    limits (server/keys.py): a 429 with Retry-After and the x-ratelimit-* headers, which every answer to
    a limited key carries. The key's policy goes into the request's state (`api_key`) for the per-request
    checks (ServerState.parse); the tokens a request used are charged to its key when it ends (its
    `access` accounting)."""

    def __init__(self, app, policies: list, limiter=None, all_routes: bool = False) -> None:
        self.app = app
        self.policies = [(p.key.encode(), p) for p in policies]
        self.limiter = limiter
        self.public = ("/health",) if all_routes else PUBLIC_PATHS
        self.public_prefixes = () if all_routes else PUBLIC_PREFIXES

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not self.policies or scope["path"] in self.public or scope["method"] == "OPTIONS" \
                or (self.public_prefixes and scope["path"].startswith(self.public_prefixes)):
            return await self.app(scope, receive, send)
        sent = dict(scope["headers"])
        header = sent.get(b"authorization", b"")
        scheme, _, token = header.partition(b" ")
        if b"x-api-key" in sent:
            scheme, token = b"bearer", sent[b"x-api-key"]
        elif not header:
            return await send_error(send, scope, 401, "missing API key: send the header 'Authorization: Bearer <key>' "
                                    "or 'x-api-key: <key>'", "missing_api_key", [(b"www-authenticate", b"Bearer")])
        # Check every key without stopping early, so the timing does not say which one came close.
        found = None
        for key, policy in self.policies:
            if hmac.compare_digest(token.strip(), key) and found is None:
                found = policy
        if scheme.lower() != b"bearer" or found is None:
            return await send_error(send, scope, 401, "invalid API key", "invalid_api_key",
                                    [(b"www-authenticate", b"Bearer")])
        scope.setdefault("state", {})["api_key"] = found
        if self.limiter is None or (found.requests_per_minute is None and found.tokens_per_minute is None):
            return await self.app(scope, receive, send)
        wait, headers = self.limiter.admit(found)
        if wait is not None:
            return await send_error(send, scope, 429,
                                    f"rate limit reached for key {found.name!r}; retry in {wait:.1f} s",
                                    "rate_limit_exceeded", headers + retry_after(wait))

        async def send_with_headers(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *headers]}
            await send(message)

        try:
            await self.app(scope, receive, send_with_headers)
        finally:
            access = scope["state"].get("access") or {}
            self.limiter.charge(found, int(access.get("prompt_tokens") or 0) + int(access.get("output_tokens") or 0))


class BodySizeLimit:
    """413 for bodies over `max_bytes`: at once from Content-Length, else while reading a chunked body.

    The body is read here in full (handlers read it whole anyway) and replayed to the app."""

    def __init__(self, app, max_bytes: int, path_limits: dict[str, int] | None = None) -> None:
        self.app, self.max_bytes = app, max_bytes
        self.path_limits = path_limits or {}     # e.g. file uploads, sized by their own flag

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            return await self.app(scope, receive, send)
        limit = self.path_limits.get(scope["path"], self.max_bytes)
        flag = "--batch-max-file-bytes" if scope["path"] in self.path_limits else "--max-body-bytes"
        too_big = f"request body is larger than the limit of {limit} bytes (raise it with {flag})"
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            return await send_error(send, scope, 413, too_big, "request_too_large")
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                return await send_error(send, scope, 413, too_big, "request_too_large")
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()          # after the body: wait for the client's disconnect

        return await self.app(scope, replay, send)

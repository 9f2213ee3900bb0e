"""One batch line through the server's own route code, in process: the same parsing, validation,
sampling parameters, engine call and response body as an HTTP request to that endpoint.

tokenfab.batch runs lines through a `RouteCall` it is handed (batch/runner.py): the server's Batch API
hands it `call_route` on the serving app, `tokenfab batch run` the app of `offline_routes`, never served.

The route handler gets a starlette Request built around the line's body; its APIErrors become the
line's error response (status and OpenAI error body), exactly what an HTTP client would have seen.
Every line runs in the batch service class (`service_tier: "flex"`), whatever the line asked for.
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
from collections.abc import AsyncIterator

from starlette.requests import Request

from tokenfab.batch.runner import RouteCall
from tokenfab.server import chat, completions
from tokenfab.server.errors import APIError

log = logging.getLogger("tokenfab.batch")
ROUTES = {"/v1/chat/completions": chat.create_chat_completion,
          "/v1/completions": completions.create_completion}
BATCH_TIER = "flex"
# Answers that say "not now" rather than "this line is wrong": the line is retried, not recorded.
RETRYABLE = {429, 503}


async def call_route(app, url: str, body: dict) -> tuple[int, str | None, dict]:
    """(status code, request id, response body) of POSTing `body` to `url` on `app`."""
    raw = json.dumps({**body, "service_tier": BATCH_TIER}).encode()
    sent = False
    never = asyncio.Event()

    async def receive():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": raw, "more_body": False}
        await never.wait()                 # no client to disconnect: the batch runner cancels instead
        return {"type": "http.disconnect"}

    scope = {"type": "http", "method": "POST", "path": url, "headers": [(b"content-type", b"application/json")],
             "query_string": b"", "app": app, "state": {}, "client": None, "server": None, "scheme": "http",
             "root_path": "", "http_version": "1.1"}
    try:
        response = await ROUTES[url](Request(scope, receive))
    except APIError as e:
        return e.status, None, e.body()
    except Exception as e:             # what the app's handler would answer over HTTP: a 500, logged
        log.exception("batch line to %s failed", url)
        return 500, None, APIError(500, f"internal error ({type(e).__name__}); the server log has details").body()
    return response.status_code, response.headers.get("x-request-id"), json.loads(response.body)


@contextlib.asynccontextmanager
async def offline_routes(engine) -> AsyncIterator[RouteCall]:
    """The server's routes on `engine` with no socket (`tokenfab batch run`): the app started for the run."""
    from tokenfab.server.app import build_app
    from tokenfab.server.config import ServerConfig
    app = build_app(engine, ServerConfig(access_log=False, ui=False, max_waiting_requests=None))
    async with app.router.lifespan_context(app):
        yield functools.partial(call_route, app)

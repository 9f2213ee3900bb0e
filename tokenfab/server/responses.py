"""/v1/responses: OpenAI's Responses API over the chat pipeline.

    POST   /v1/responses                           create, whole or streamed (typed events)
    GET    /v1/responses/{id}                      a stored response
    DELETE /v1/responses/{id}                      forget it
    GET    /v1/responses/{id}/input_items          the items it saw, as a list (order, limit, after)

A Responses body is mapped onto a chat completions request (server/responses_input.py) and run by the
same code as /v1/chat/completions: `chat.prepare` (checks, chat template, tools, structured output,
SamplingParams), the engine, and the reply's parsers (server/reply.py). Only the two ends differ: the
body on the way in, and output items and typed events on the way out (server/responses_reply.py).

Stored responses (`store`, true unless false is given) live in the data dir's SQLite store, beside the
Batch API's files and jobs (batch/store.py), so a server restarted on the same `--data-dir` still
finds them; without --data-dir that store is a temporary directory, and stored responses last as long
as the server. A response is stored once it has finished (a streamed one before its last event), with
every input item it saw: `previous_response_id` puts that response's input items and output before the
new input, and `input_items` lists them all. An unknown or unstored id is a 404.
"""
from __future__ import annotations

import asyncio
import time
from typing import Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, Response

from tokenfab.batch.store import BatchStore, StoreError
from tokenfab.server import chat
from tokenfab.server.errors import APIError
from tokenfab.server.limits import check_metadata
from tokenfab.server.logprobs import chat_logprobs
from tokenfab.server.protocol import ChatCompletionRequest
from tokenfab.server.responses_input import in_responses_terms, input_items, new_id, text_format, to_chat_request
from tokenfab.server.responses_protocol import ResponsesRequest
from tokenfab.server.responses_reply import (ResponseEvents, count_tokens, finished, output_items, response_events,
                                             usage)
from tokenfab.server.state import ServerState
from tokenfab.server.streaming import framed, sse_response

router = APIRouter()


def _store(request: Request) -> BatchStore:
    return request.app.state.batches.store


@router.post("/v1/responses")
async def create_response(request: Request) -> Response:
    arrival = time.monotonic()
    st: ServerState = request.app.state.tokenfab
    req: ResponsesRequest = await st.parse(request, ResponsesRequest)
    st.check_model(req.model)
    bad = req.unsupported(reasoning=st.config.reasoning_parser is not None)
    if bad is not None:
        raise APIError(400, f"{bad[0]}: {bad[1]}", param=bad[0], code="unsupported")
    check_metadata(req.metadata)
    items = input_items(req)
    if req.previous_response_id is not None:
        prev, prev_items = await asyncio.to_thread(_store(request).get_response, req.previous_response_id,
                                                   "previous_response_id")
        items = prev_items + prev["output"] + items
    chat_req = to_chat_request(req, items)
    key = request.scope.get("state", {}).get("api_key")
    try:
        if key is not None:           # the key's limits, on the request as chat sees it
            st.check_key(key, chat_req)
        p = await chat.prepare(st, chat_req)
    except APIError as e:
        raise in_responses_terms(e) from None

    rid = new_id("resp")
    created = _created(st, req, chat_req, rid)
    store = req.store is not False

    async def done(response: dict) -> None:
        if store:
            await asyncio.to_thread(_store(request).add_response, response, items)

    access = request.state.access = {"id": rid, "prompt_tokens": len(p.ids), "output_tokens": 0}
    (stream,) = await st.start(rid, [p.ids], p.params, 0, arrival, p.service_class)
    if req.stream:
        ev = ResponseEvents()
        events = response_events(ev, st, created, stream, p.reply, p.top_n, access, arrival, done)
        return sse_response(framed(events, [stream], access, error_event=ev.error, done=None), rid)
    (final,) = await st.collect(request, [stream])
    (o,) = final.outputs
    message, finish_reason = p.reply.message(o.text, o.finish_reason)
    lps = chat_logprobs(st.token_text, o.token_ids, o.logprobs or [], p.top_n)["content"] if p.top_n is not None else []
    m = final.metrics
    access.update(output_tokens=len(o.token_ids),
                  ttft_s=m.first_token_time - arrival if m and m.first_token_time else None)
    body = finished(created, output_items(message, finish_reason, lps), finish_reason, usage(
        len(p.ids), len(o.token_ids), final.num_cached_tokens, count_tokens(st, message.get("reasoning_content") or "")))
    await done(body)
    return JSONResponse(body, headers={"X-Request-Id": rid})


def _created(st: ServerState, req: ResponsesRequest, chat_req: ChatCompletionRequest, rid: str) -> dict:
    """The response object as it is created: the request's settings echoed, no output yet."""
    effort = (req.reasoning or {}).get("effort")
    return {"id": rid, "object": "response", "created_at": int(time.time()), "status": "in_progress",
            "background": False, "completed_at": None, "error": None, "incomplete_details": None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens, "max_tool_calls": None,
            "model": req.model or st.model_name, "output": [], "parallel_tool_calls": chat_req.parallel_tool_calls,
            "previous_response_id": req.previous_response_id, "reasoning": {"effort": effort, "summary": None},
            "service_tier": req.service_tier or "default", "store": req.store is not False,
            "temperature": req.temperature if req.temperature is not None else 1.0,
            "text": {"format": text_format(req), "verbosity": "medium"},
            "tool_choice": req.tool_choice if req.tool_choice is not None else "auto", "tools": req.tools or [],
            "top_logprobs": req.top_logprobs or 0, "top_p": req.top_p if req.top_p is not None else 1.0,
            "truncation": "disabled", "usage": None, "user": req.user, "metadata": req.metadata or {}}


@router.get("/v1/responses/{response_id}")
async def get_response(request: Request, response_id: str) -> dict:
    obj, _ = await asyncio.to_thread(_store(request).get_response, response_id)
    return obj


@router.delete("/v1/responses/{response_id}")
async def delete_response(request: Request, response_id: str) -> dict:
    return await asyncio.to_thread(_store(request).delete_response, response_id)


@router.get("/v1/responses/{response_id}/input_items")
async def list_input_items(request: Request, response_id: str, order: Literal["asc", "desc"] = "desc",
                           limit: int = Query(20), after: str | None = None) -> dict:
    """OpenAI's list: newest first unless order is asc; `after` is the last id of the previous page."""
    if not 1 <= limit <= 100:
        raise APIError(400, f"limit must be in 1..100, got {limit}", param="limit", code="invalid_value")
    _, items = await asyncio.to_thread(_store(request).get_response, response_id)
    if order == "desc":
        items = items[::-1]
    if after is not None:
        ids = [x["id"] for x in items]
        if after not in ids:
            raise StoreError(400, f"after: the response has no input item with id {after!r}", "invalid_cursor", "after")
        items = items[ids.index(after) + 1:]
    page = items[:limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit}

"""Server-sent events: framing, merging several requests' streams, and per-choice deltas.

Engine outputs are cumulative; `ChoiceDelta` turns them into what is new since the last chunk, for
one choice. A chunk is sent only when it carries text or a finish reason, so clients never see an
empty content chunk (chat's opening role chunk aside). Tokens whose text is still held back (half a
UTF-8 character, the possible start of a stop string) wait, with their logprobs, for the next chunk.
"""
from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from fastapi.responses import StreamingResponse

from tokenfab.engine.client import EngineDeadError, RequestFailed
from tokenfab.engine.streams import RequestStream
from tokenfab.outputs import CompletionOutput, RequestOutput
from tokenfab.server.errors import error_body

DONE = "data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def sse_response(body: AsyncIterator[str], request_id: str) -> StreamingResponse:
    return StreamingResponse(body, media_type="text/event-stream",
                             headers={**SSE_HEADERS, "X-Request-Id": request_id})


def openai_error_event(message: str) -> str:
    return sse(error_body(message, "internal_error", code="engine_error"))


async def framed(chunks: AsyncIterator[str], streams: list[RequestStream], access: dict, *,
                 error_event: Callable[[str], str] = openai_error_event,
                 done: str | None = DONE) -> AsyncIterator[str]:
    """The common frame of a streamed response around an endpoint's own chunks: `done` at the end
    (OpenAI's [DONE]; None for APIs without one), an engine failure as `error_event(message)`, and
    however it ends, the requests aborted (a client that left frees its KV blocks at once)."""
    try:
        async for c in chunks:
            yield c
        if done is not None:
            yield done
    except (RequestFailed, EngineDeadError) as e:
        access["outcome"] = "engine_error"
        yield error_event(str(e))
        if done is not None:
            yield done
    finally:
        if any(not s.finished for s in streams) and "outcome" not in access:
            access["outcome"] = "client_disconnected"
        for s in streams:
            s.abort()
        await chunks.aclose()


async def merged(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(stream index, output) from several streams as they arrive; raises the first failure."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                queue.put_nowait((i, out))
            queue.put_nowait((i, None))
        except Exception as e:
            queue.put_nowait((i, e))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()


@dataclass(slots=True)
class Delta:
    text: str
    token_ids: list[int]
    logprobs: list                   # engine entries for token_ids, or [] when not asked
    finish_reason: str | None
    stop_reason: int | str | None


@dataclass(slots=True)
class ChoiceDelta:
    """What one choice has sent so far."""
    chars: int = 0
    tokens: int = 0
    finished: bool = False
    first: bool = True
    token_count: int = field(default=0)   # all tokens generated (sent or held)

    def advance(self, out: CompletionOutput) -> Delta | None:
        """The delta to send now, or None when there is nothing worth a chunk."""
        if self.finished:
            return None
        self.token_count = len(out.token_ids)
        finish = out.finish_reason
        text = out.text[self.chars:] if len(out.text) > self.chars else ""
        if not text and finish is None:
            return None
        # The engine's logprobs list grows in its thread; entries below len(token_ids) are final.
        ids = out.token_ids[self.tokens:]
        lps = out.logprobs[self.tokens:len(out.token_ids)] if out.logprobs is not None else []
        self.chars += len(text)
        self.tokens = len(out.token_ids)
        self.finished = finish is not None
        return Delta(text, ids, lps, finish, out.stop_reason if finish else None)

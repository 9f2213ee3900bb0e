"""Request streams on the event loop: the part of an EngineClient that both of them share.

    stream = await client.add_request(rid, prompt_ids, params)   # ValueError: bad input, nothing queued
    async for out in stream:                                     # cumulative RequestOutputs
        ...
    stream.abort()                                               # the client left: free its blocks now

`StreamClient` keeps one RequestStream per request, hands it the outputs, and tells the listener
(metrics, SLO) about first tokens, inter-token gaps and finishes. Where the outputs come from is the
subclass's business: an engine thread (engine/async_engine.py) or replicas (serve_ray/pool.py); each
says how to stop a request on its side (`_cancel`).
"""
from __future__ import annotations

import asyncio
import logging
from collections import deque

from tokenfab.engine.client import EngineListener, RequestFailed
from tokenfab.outputs import RequestOutput

log = logging.getLogger("tokenfab.engine")


class RequestStream:
    """One request's outputs, consumed on the event loop. Outputs are cumulative, so an unread output
    is replaced by the next one: a slow reader skips to the newest, and memory stays one output deep."""

    def __init__(self, request_id: str, owner: "StreamClient") -> None:
        self.request_id = request_id
        self.prompt_token_ids: list[int] = []
        self.finished = False
        self.last: RequestOutput | None = None
        self._owner = owner
        self._items: deque[RequestOutput | BaseException] = deque()
        self._ready = asyncio.Event()
        self._num_tokens = 0                    # generated so far over all n samples (for ITL)
        self._last_token_time: float | None = None

    def _put(self, item: RequestOutput | BaseException) -> None:
        last = self._items[-1] if self._items else None
        if isinstance(item, RequestOutput) and isinstance(last, RequestOutput) and not last.finished:
            self._items[-1] = item           # cumulative: the newer output supersedes the unread one
        else:
            self._items.append(item)
        self._ready.set()

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished and not self._items:
            raise StopAsyncIteration
        while not self._items:
            self._ready.clear()
            await self._ready.wait()
        item = self._items.popleft()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        self.last = item
        if item.finished:
            self.finished = True
        return item

    async def result(self) -> RequestOutput:
        """Wait for the final output."""
        async for _ in self:
            pass
        assert self.last is not None
        return self.last

    def abort(self) -> None:
        """Stop the request now (its KV blocks are freed at the engine's next turn). Idempotent."""
        if not self.finished:
            self.finished = True
            self._owner.abort(self.request_id)


class StreamClient:
    """The streams of the requests in flight, touched only on the event loop."""

    def __init__(self, listener: EngineListener | None = None) -> None:
        self.listener = listener
        self._streams: dict[str, RequestStream] = {}

    @property
    def num_requests(self) -> int:
        """Requests accepted and not finished (each counts once whatever its n)."""
        return len(self._streams)

    def _open(self, request_id: str) -> RequestStream:
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        stream = self._streams[request_id] = RequestStream(request_id, self)
        return stream

    def _cancel(self, request_id: str) -> None:
        """Stop the request where it runs (free its blocks); its stream is closed already."""
        raise NotImplementedError

    def abort(self, request_id: str) -> None:
        stream = self._streams.pop(request_id, None)
        if stream is None:
            return
        stream.finished = True
        self._cancel(request_id)
        if self.listener:
            self.listener.on_finished("abort", stream.last)

    def _deliver(self, outputs: list[RequestOutput], now: float) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue                     # aborted while this step ran
            try:
                self._deliver_one(stream, out, now)
            except Exception as e:            # a bug on one request's path must not stop the others
                log.exception("request %s: failed while handling its output", out.request_id)
                self._fail(stream, RequestFailed(f"internal error while handling this request: {e}"), abort=True)

    def _deliver_one(self, stream: RequestStream, out: RequestOutput, now: float) -> None:
        num_tokens = sum(len(o.token_ids) for o in out.outputs)
        new = num_tokens - stream._num_tokens
        if new > 0 and self.listener:
            if stream._last_token_time is None:
                self.listener.on_first_token(out)
            else:
                self.listener.on_itl(now - stream._last_token_time, new)
        if new > 0:
            stream._num_tokens, stream._last_token_time = num_tokens, now
        failed = [o for o in out.outputs if o.finish_reason == "error"]
        if failed or out.error:
            self._fail(stream, RequestFailed(out.error or "the engine failed on this request"), abort=not out.finished)
            return
        stream._put(out)
        if out.finished:
            self._streams.pop(stream.request_id, None)
            if self.listener:
                self.listener.on_finished(out.outputs[0].finish_reason or "stop", out)

    def _fail(self, stream: RequestStream, error: BaseException, abort: bool) -> None:
        self._streams.pop(stream.request_id, None)
        if abort:
            self._cancel(stream.request_id)
        stream._put(error)
        if self.listener:
            self.listener.on_finished("error", stream.last)

    def _fail_all(self, error: BaseException) -> None:
        for stream in list(self._streams.values()):
            self._streams.pop(stream.request_id, None)
            stream._put(error)

"""A scripted OpenAI-compatible streaming server with known timing, for tests and self-checks.

It answers /v1/completions and /v1/chat/completions with `max_tokens` tokens (" tok" each): the
first content chunk at `ttft_ms` (+ `ttft_ms_per_word` per prompt word) after the request
arrived, and one chunk every `chunk_interval_ms` after that, each carrying the next entry of
`tokens_per_chunk` (cycled). Deadlines are absolute, so sleep jitter never accumulates. Chat
streams open with a role-only chunk at once, which carries no content and must not count as
the first token. A prompt containing FAILMID errors inside the stream after its first chunk; any
other prompt containing FAIL gets HTTP 500. Token counts go out as the request asks
(`stream_options`), or as forced by `usage`: continuous | final | none | logprobs. With `tool_calls`,
a chat request that has `tools` and ends in a user message is answered by a call of its first tool,
streamed as `tool_calls` deltas whose arguments carry the tokens (an agent's turn; see agent.py).

  python -m tokenfab.bench.fake_server --port 8123 --ttft-ms 50 --interval-ms 20 --tokens-per-chunk 1,1,3
  tokenfab bench serve --base-url http://127.0.0.1:8123 --tokenizer none

then TTFT should read 50 ms, and so on. It uses plain asyncio streams: no framework overhead
between the script and the socket. GET /stats reports the peak number of requests in flight.

On a busy machine real sleeps overshoot by milliseconds, so exact tests run the server and the
bench in one `VirtualClockLoop`: its clock jumps over idle time instead of waiting, which makes
every scripted delay come out exactly, through real sockets, HTTP and SSE parsing.
"""
from __future__ import annotations

import argparse
import asyncio
import itertools
import json
from dataclasses import dataclass, field


@dataclass(slots=True)
class FakeScript:
    ttft_ms: float = 50.0
    ttft_ms_per_word: float = 0.0
    chunk_interval_ms: float = 20.0
    tokens_per_chunk: tuple[int, ...] = (1,)
    usage: str = "auto"            # auto (follow stream_options) | continuous | final | none | logprobs
    model: str = "fake-model"
    tool_calls: bool = False       # answer a user turn that comes with tools by calling the first tool


@dataclass(slots=True)
class FakeStats:
    in_flight: int = 0
    max_in_flight: int = 0
    served: int = 0
    arrivals: list[float] = field(default_factory=list)   # the loop's clock at each request's arrival
    bodies: list[dict] = field(default_factory=list)      # each request's JSON body, in arrival order


class FakeServer:
    def __init__(self, script: FakeScript):
        self.script = script
        self.stats = FakeStats()

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """HTTP/1.1 with keep-alive, as real servers do: a client reuses its connections."""
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                arrived = asyncio.get_running_loop().time()
                lines = head.decode("latin-1").split("\r\n")
                method, path, _ = lines[0].split(" ", 2)
                headers = {k.strip().lower(): v.strip() for k, _, v in (l.partition(":") for l in lines[1:] if l)}
                body = await reader.readexactly(int(headers.get("content-length", 0)))
                await self.route(method, path, body, arrived, writer)
                await writer.drain()
                if headers.get("connection", "").lower() == "close":
                    break
        except (asyncio.IncompleteReadError, ConnectionError, ValueError):
            pass
        finally:
            writer.close()

    async def route(self, method: str, path: str, body: bytes, arrived: float, w: asyncio.StreamWriter) -> None:
        if method == "GET" and path == "/v1/models":
            return _send_json(w, 200, {"object": "list", "data": [{"id": self.script.model, "object": "model"}]})
        if method == "GET" and path == "/health":
            return _send_json(w, 200, {"status": "ok"})
        if method == "GET" and path.startswith("/stats"):
            s = self.stats
            _send_json(w, 200, {"in_flight": s.in_flight, "max_in_flight": s.max_in_flight, "served": s.served,
                                "arrivals": s.arrivals})
            if "reset" in path:
                self.stats = FakeStats()
            return None
        if method == "POST" and path in ("/v1/completions", "/v1/chat/completions"):
            self.stats.arrivals.append(arrived)
            self.stats.bodies.append(json.loads(body or b"{}"))
            return await self.stream(self.stats.bodies[-1], path.endswith("chat/completions"), arrived, w)
        return _send_json(w, 404, _error(f"no route {method} {path}", "not_found"))

    async def stream(self, req: dict, chat: bool, arrived: float, w: asyncio.StreamWriter) -> None:
        prompt = " ".join(m.get("content") or "" for m in req.get("messages", [])) if chat else str(req.get("prompt", ""))
        if "FAIL" in prompt and "FAILMID" not in prompt:
            return _send_json(w, 500, _error("scripted failure", "server_error"))
        if not req.get("stream"):
            return _send_json(w, 400, _error("the fake server only streams; set stream: true", "invalid_request_error"))
        s, stats = self.script, self.stats
        n_prompt, n_out = len(prompt.split()), int(req.get("max_tokens") or 16)
        opts = req.get("stream_options") or {}
        usage = s.usage if s.usage != "auto" else (
            "continuous" if opts.get("continuous_usage_stats") else "final" if opts.get("include_usage") else "none")
        msgs = req.get("messages") or [{}]
        call = (s.tool_calls and chat and req.get("tools") and msgs[-1].get("role") == "user"
                and {"id": f"call_{len(stats.arrivals)}", "name": req["tools"][0]["function"]["name"]})
        stats.in_flight += 1
        stats.max_in_flight = max(stats.max_in_flight, stats.in_flight)
        loop = asyncio.get_running_loop()
        try:
            w.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
                    b"Transfer-Encoding: chunked\r\n\r\n")
            if chat:
                _event(w, _chunk(s.model, chat, "", None, None, role=True))
            await w.drain()
            first = arrived + (s.ttft_ms + s.ttft_ms_per_word * n_prompt) / 1e3
            done, sizes = 0, itertools.cycle(s.tokens_per_chunk)
            for j in itertools.count():
                if done >= n_out:
                    break
                k = min(next(sizes), n_out - done)
                done += k
                await asyncio.sleep(max(0.0, first + j * s.chunk_interval_ms / 1e3 - loop.time()))
                u = {"prompt_tokens": n_prompt, "completion_tokens": done, "total_tokens": n_prompt + done} \
                    if usage == "continuous" else None
                finish = None if done < n_out else "tool_calls" if call else "length"
                _event(w, _chunk(s.model, chat, " tok" * k, finish, u, logprobs=k if usage == "logprobs" else None,
                                 call=call, first=j == 0))
                await w.drain()
                if j == 0 and "FAILMID" in prompt:
                    _event(w, _error("scripted failure in the stream", "server_error"))
                    w.write(b"0\r\n\r\n")
                    return
            if usage in ("continuous", "final"):
                _event(w, {"object": "chat.completion.chunk" if chat else "text_completion", "model": s.model,
                           "choices": [], "usage": {"prompt_tokens": n_prompt, "completion_tokens": n_out,
                                                    "total_tokens": n_prompt + n_out}})
            _write_chunk(w, b"data: [DONE]\n\n")
            w.write(b"0\r\n\r\n")  # end of the chunked body; the connection stays open
            await w.drain()
            stats.served += 1
        finally:
            stats.in_flight -= 1


def _chunk(model: str, chat: bool, text: str, finish: str | None, usage: dict | None, role: bool = False,
           logprobs: int | None = None, call: dict | None = None, first: bool = False) -> dict:
    if chat:
        delta = {"role": "assistant", "content": ""} if role else {"content": text}
        if call and not role:      # the tokens go into the call's arguments: {"query": " tok tok …"}
            piece = ('{"query": "' if first else "") + text + ('"}' if finish else "")
            d = {"index": 0, "function": {"arguments": piece}}
            if first:
                d.update(id=call["id"], type="function", function={"name": call["name"], "arguments": piece})
            delta = {"tool_calls": [d]}
        choice = {"index": 0, "delta": delta, "finish_reason": finish}
        if logprobs:
            choice["logprobs"] = {"content": [{"token": " tok", "logprob": 0.0}] * logprobs}
    else:
        choice = {"index": 0, "text": text, "finish_reason": finish,
                  "logprobs": {"tokens": [" tok"] * logprobs} if logprobs else None}
    out = {"id": "fake", "object": "chat.completion.chunk" if chat else "text_completion", "model": model,
           "choices": [choice]}
    if usage is not None:
        out["usage"] = usage
    return out


def _error(message: str, kind: str) -> dict:
    return {"error": {"message": message, "type": kind, "param": None, "code": None}}


def _event(w: asyncio.StreamWriter, obj: dict) -> None:
    _write_chunk(w, b"data: " + json.dumps(obj).encode() + b"\n\n")


def _write_chunk(w: asyncio.StreamWriter, data: bytes) -> None:
    w.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")


def _send_json(w: asyncio.StreamWriter, status: int, obj: dict) -> None:
    body = json.dumps(obj).encode()
    reason = {200: "OK", 400: "Bad Request", 404: "Not Found", 500: "Internal Server Error"}[status]
    w.write(f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            f"\r\n".encode() + body)


class _JumpingSelector:
    """Wraps the loop's selector: when no socket is ready, move the clock to the next timer."""

    def __init__(self, real, loop: "VirtualClockLoop", grace_s: float):
        self._real, self._loop, self._grace = real, loop, grace_s

    def select(self, timeout=None):
        ready = self._real.select(0)
        if ready or timeout == 0:
            return ready
        if timeout is None:  # no timer pending: only real I/O can move things on
            return self._real.select(None)
        # Loopback data is delivered within the sender's send(); the grace covers stragglers.
        ready = self._real.select(min(timeout, self._grace))
        if not ready:
            self._loop.virtual_now += timeout
        return ready

    def __getattr__(self, name):
        return getattr(self._real, name)


class VirtualClockLoop(asyncio.SelectorEventLoop):
    """An event loop whose time() only moves when every task is waiting for a timer.

    All work between two waits takes zero time on this clock, so a server that sleeps 40 ms
    before its first chunk yields a TTFT of exactly 40 ms for a client on the same loop. Pass
    `loop.time` as the bench's clock. Only for loopback sockets within one process.
    """

    def __init__(self, grace_s: float = 0.005):
        super().__init__()
        self.virtual_now = 1000.0
        self._selector = _JumpingSelector(self._selector, self, grace_s)

    def time(self) -> float:
        return self.virtual_now


async def start_fake_server(script: FakeScript, host: str = "127.0.0.1",
                            port: int = 0) -> tuple[FakeServer, asyncio.Server, str]:
    """Start serving on the running loop: (the fake, the asyncio server, its base URL)."""
    fake = FakeServer(script)
    server = await asyncio.start_server(fake.handle, host, port, backlog=1024)
    return fake, server, f"http://{host}:{server.sockets[0].getsockname()[1]}"


async def serve(script: FakeScript, host: str = "127.0.0.1", port: int = 0) -> None:
    _, server, url = await start_fake_server(script, host, port)
    print(f"fake server listening on {url}", flush=True)
    async with server:
        await server.serve_forever()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="A scripted OpenAI-compatible streaming server with known timing.")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="0 picks a free port (printed at start)")
    p.add_argument("--ttft-ms", type=float, default=50.0)
    p.add_argument("--ttft-ms-per-word", type=float, default=0.0)
    p.add_argument("--interval-ms", type=float, default=20.0, help="time between content chunks")
    p.add_argument("--tokens-per-chunk", default="1", help="comma-separated, cycled, e.g. 1,1,3")
    p.add_argument("--usage", default="auto", choices=["auto", "continuous", "final", "none", "logprobs"])
    a = p.parse_args(argv)
    script = FakeScript(a.ttft_ms, a.ttft_ms_per_word, a.interval_ms,
                        tuple(int(x) for x in a.tokens_per_chunk.split(",")), a.usage)
    try:
        asyncio.run(serve(script, a.host, a.port))
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()

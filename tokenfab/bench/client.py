"""One streaming request to an OpenAI-compatible endpoint, timed per SSE chunk.

Timing uses `time.perf_counter()`: `sent` is taken just before the request goes out and each
`data:` line is stamped as it is read. Token counts per chunk come from the server: a chunk's
`usage.completion_tokens` (cumulative; vLLM and SGLang send it on every chunk when asked with
`stream_options.continuous_usage_stats`) or its logprobs entries. The final usage chunk
(`stream_options.include_usage`) gives the total. What the server did not say is resolved later,
in timing.py. Errors are kept as one-line strings on the result (with the HTTP status, when there
was one); nothing raises out of here.

`bench soak` also sends requests without streaming (`plain_request`: the whole answer is one event at
its end), and hangs up on purpose (`hang_up_after`: the client closes the connection after that many
content chunks, 0 meaning right after the response headers), as real clients do.
"""
from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

from tokenfab.bench.datasets import BenchRequest

STREAM_USAGE = ("continuous", "final", "off")


def normalize_base_url(url: str) -> str:
    """``http://host:8000``, ``.../`` and ``.../v1`` all mean the same server."""
    url = url.strip().rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"base URL {url!r} must start with http:// or https:// (e.g. http://127.0.0.1:8000)")
    return url[:-3] if url.endswith("/v1") else url


@dataclass(slots=True)
class Endpoint:
    base_url: str
    model: str
    kind: str = "completions"           # completions | chat
    api_key: str | None = None
    stream_usage: str = "continuous"    # continuous: usage on every chunk; final: once at the end; off
    ignore_eos: bool = True             # so outputs have the length asked for (vLLM/SGLang/llama.cpp honour it)
    temperature: float = 0.0
    extra_body: dict = field(default_factory=dict)
    timeout_s: float = 600.0

    @property
    def url(self) -> str:
        return f"{self.base_url}/v1/{'chat/completions' if self.kind == 'chat' else 'completions'}"

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def payload(self, req: BenchRequest) -> dict:
        body: dict = {"model": self.model, "max_tokens": req.output_len, "temperature": self.temperature,
                      "stream": True}
        if self.kind == "chat":
            body["messages"] = req.messages if req.messages is not None else [{"role": "user", "content": req.prompt}]
            if req.tools:
                body["tools"] = req.tools
        else:
            body["prompt"] = req.prompt if req.prompt is not None else "".join(m["content"] for m in req.messages)
        if self.stream_usage != "off":
            body["stream_options"] = {"include_usage": True}
            if self.stream_usage == "continuous":
                body["stream_options"]["continuous_usage_stats"] = True
        if self.ignore_eos:
            body["ignore_eos"] = True
        body.update(self.extra_body)
        return body


@dataclass(slots=True)
class ChunkEvent:
    t: float              # seconds since the request was sent
    text: str
    tokens: int | None    # tokens this chunk carries, when the server said so


@dataclass(slots=True)
class RawResult:
    sent: float = 0.0                     # perf_counter just before sending
    end: float = 0.0                      # perf_counter when the stream closed
    events: list[ChunkEvent] = field(default_factory=list)
    completion_tokens: int | None = None  # the last usage total seen
    prompt_tokens: int | None = None      # the server's count of the prompt
    count_source: str | None = None       # "usage" or "logprobs" when chunks carried counts
    finish_reason: str | None = None
    error: str | None = None
    status: int | None = None             # the HTTP status, once the response headers came
    hung_up: bool = False                 # the client closed the stream on purpose (hang_up_after)
    content: str = ""                     # chat: the reply's content, without reasoning (for a next turn)
    tool_calls: list[dict] = field(default_factory=list)   # chat: the reply's tool calls, deltas merged


async def stream_request(client: httpx.AsyncClient, ep: Endpoint, req: BenchRequest,
                         clock: Callable[[], float] = time.perf_counter, hang_up_after: int | None = None) -> RawResult:
    """Send `req` and time its chunks. `clock` is perf_counter; tests pass a virtual one. With
    `hang_up_after` = k the client closes the connection after k content chunks (0: after the headers)."""
    payload, headers = ep.payload(req), ep.headers()
    res = RawResult()
    res.sent = clock()
    try:
        async with client.stream("POST", ep.url, json=payload, headers=headers) as resp:
            res.status = resp.status_code
            if resp.status_code != 200:
                res.error = f"HTTP {resp.status_code}: {_error_message((await resp.aread()).decode(errors='replace'))}"
                return res
            if hang_up_after == 0:
                res.hung_up = True
                return res                # before the first chunk: mid-prefill, for a long prompt
            async for line in resp.aiter_lines():
                if hang_up_after is not None and len(res.events) >= hang_up_after:
                    res.hung_up = True
                    break                 # leaving the block closes the connection mid-stream
                now = clock()
                if not line.startswith("data:"):
                    continue  # blank separators, comments, event: lines
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                try:
                    obj = json.loads(data)
                except json.JSONDecodeError:
                    res.error = f"malformed SSE data: {data[:80]!r}"
                    break
                if isinstance(obj, dict) and obj.get("error"):
                    res.error = f"error in stream: {_error_message(json.dumps(obj))}"
                    break
                _absorb(res, obj, now - res.sent, ep.kind)
    except httpx.TimeoutException:
        res.error = f"timed out after {ep.timeout_s:g} s"
    except httpx.HTTPError as e:
        res.error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    finally:
        res.end = clock()
    if res.error is None and not res.events and not res.hung_up:
        res.error = "no content received: the stream ended without a token"
    return res


async def plain_request(client: httpx.AsyncClient, ep: Endpoint, req: BenchRequest,
                        clock: Callable[[], float] = time.perf_counter) -> RawResult:
    """Send `req` without streaming: the whole answer arrives as one event when the response ends."""
    payload, headers = ep.payload(req), ep.headers()
    payload["stream"] = False
    payload.pop("stream_options", None)
    res = RawResult()
    res.sent = clock()
    try:
        resp = await client.post(ep.url, json=payload, headers=headers)
        res.end = clock()
        res.status = resp.status_code
        if resp.status_code != 200:
            res.error = f"HTTP {resp.status_code}: {_error_message(resp.text)}"
            return res
        body = resp.json()
        choice = body["choices"][0]
        if ep.kind == "chat":
            text = (choice.get("message") or {}).get("content") or ""
        else:
            text = choice.get("text") or ""
        usage = body.get("usage") or {}
        res.completion_tokens = usage.get("completion_tokens")
        res.prompt_tokens = usage.get("prompt_tokens")
        res.finish_reason = choice.get("finish_reason")
        if res.completion_tokens is not None:
            res.count_source = "usage"
        res.events.append(ChunkEvent(res.end - res.sent, text, res.completion_tokens))
    except httpx.TimeoutException:
        res.error = f"timed out after {ep.timeout_s:g} s"
    except httpx.HTTPError as e:
        res.error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    except (ValueError, KeyError, IndexError, TypeError) as e:
        res.error = f"malformed response: {type(e).__name__}: {e}"
    finally:
        res.end = res.end or clock()
    return res


def _absorb(res: RawResult, obj: dict, t: float, kind: str) -> None:
    """Fold one chunk into the result: an event if it carries content or tokens."""
    choices = obj.get("choices") or []
    usage = obj.get("usage") or None
    usage_delta = None
    if usage and usage.get("completion_tokens") is not None:
        total = int(usage["completion_tokens"])
        usage_delta = max(total - (res.completion_tokens or 0), 0)
        res.completion_tokens = max(total, res.completion_tokens or 0)
        if usage.get("prompt_tokens") is not None:
            res.prompt_tokens = int(usage["prompt_tokens"])
    if not choices:
        return  # the final usage chunk, or a keep-alive: no tokens of its own to place in time
    choice = choices[0]
    if choice.get("finish_reason"):
        res.finish_reason = choice["finish_reason"]
    if kind == "chat":
        delta = choice.get("delta") or {}
        res.content += delta.get("content") or ""
        # A tool call's name and arguments are generated tokens too: they count as content for timing.
        calls = _merge_tool_calls(res.tool_calls, delta.get("tool_calls"))
        text = (delta.get("content") or "") + (delta.get("reasoning_content") or delta.get("reasoning") or "") + calls
    else:
        text = choice.get("text") or ""
    tokens, source = usage_delta, "usage"
    if tokens is None:
        tokens, source = _logprob_count(choice.get("logprobs"), kind), "logprobs"
    if text or (tokens or 0) > 0:
        res.events.append(ChunkEvent(t, text, tokens))
        if tokens is not None:
            res.count_source = source


def _merge_tool_calls(calls: list[dict], deltas) -> str:
    """Fold streamed `tool_calls` deltas (OpenAI's shape: by `index`, the arguments in pieces) into
    `calls`; returns the name and argument text they carried."""
    text = ""
    for d in deltas if isinstance(deltas, list) else ():
        if not isinstance(d, dict):
            continue
        i = d.get("index", len(calls))
        while len(calls) <= i:
            calls.append({"id": None, "type": "function", "function": {"name": "", "arguments": ""}})
        fn = d.get("function") or {}
        calls[i]["id"] = d.get("id") or calls[i]["id"]
        calls[i]["function"]["name"] += fn.get("name") or ""
        calls[i]["function"]["arguments"] += fn.get("arguments") or ""
        text += (fn.get("name") or "") + (fn.get("arguments") or "")
    return text


def _logprob_count(logprobs, kind: str) -> int | None:
    if not isinstance(logprobs, dict):
        return None
    entries = logprobs.get("content") if kind == "chat" else logprobs.get("tokens")
    return len(entries) if isinstance(entries, list) else None


def _error_message(body: str) -> str:
    """The `error.message` of an OpenAI-shaped error body, else the body, on one short line."""
    try:
        obj = json.loads(body)
        err = obj.get("error", obj) if isinstance(obj, dict) else obj
        msg = err.get("message") or err.get("detail") or json.dumps(err) if isinstance(err, dict) else str(err)
    except (json.JSONDecodeError, AttributeError):
        msg = body
    msg = " ".join(str(msg).split())
    return msg[:200] + ("…" if len(msg) > 200 else "")

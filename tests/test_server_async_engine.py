"""Server behaviour that needs control over the engine: failures, load shedding, disconnects, drain, auth.

A scripted FakeEngine (the LLMEngine surface the server uses, one token per running request per step)
stands in for the model, so these run in seconds and can block, fail or slow a step on purpose. The
server around it is the real one, over real HTTP on a free port.
"""
from __future__ import annotations

import json
import threading
import time
from collections import deque
from types import SimpleNamespace

import httpx
import pytest

from tokenfab.engine.client import EngineStats
from tokenfab.outputs import CompletionOutput, RequestMetrics, RequestOutput
from tokenfab.server.app import build_app
from tokenfab.server.config import ServerConfig
from tokenfab.server.launch import ServerThread

pytestmark = pytest.mark.timeout(120)


class FakeRequest:
    def __init__(self, request_id, ids, params):
        self.request_id, self.ids, self.params = request_id, ids, params
        self.out: list[int] = []
        self.arrival = time.monotonic()
        self.first_token = None


class FakeEngine:
    """One token (" a") per running request per step; `gate`, `fail_next_steps` and POISON prompts script faults."""

    def __init__(self, tokenizer, max_model_len: int = 256, max_running: int = 64):
        self.tokenizer = tokenizer
        self.model_config = SimpleNamespace(vocab_size=len(tokenizer))
        self.config = SimpleNamespace(scheduling_policy="fcfs", max_num_seqs=4)
        self.model_path = None
        self.max_model_len, self.max_running = max_model_len, max_running
        self.token = tokenizer(" a").input_ids[0]
        self.requests: dict[str, FakeRequest] = {}
        self.waiting: deque[FakeRequest] = deque()
        self.scheduler = SimpleNamespace(running=[])
        self.aborted: list[str] = []
        self.gate = threading.Event()
        self.gate.set()
        self.in_step = threading.Event()
        self.fail_next_steps = 0
        self.step_delay = 0.0
        self.generated = 0

    def tokenize(self, prompt):
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            return list(self.tokenizer(prompt).input_ids)
        return list(prompt)

    def add_request(self, request_id, prompt, params, priority=0, arrival_time=None, service_class="interactive"):
        ids = self.tokenize(prompt)
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens but max_model_len is {self.max_model_len}")
        req = FakeRequest(request_id, ids, params)
        self.requests[request_id] = req
        self.waiting.append(req)
        return ids

    def abort_request(self, request_id):
        req = self.requests.pop(request_id, None)
        if req is None:
            return False
        self.aborted.append(request_id)
        if req in self.waiting:
            self.waiting.remove(req)
        if req in self.scheduler.running:
            self.scheduler.running.remove(req)
        return True

    def has_unfinished_requests(self):
        return bool(self.requests)

    def num_used_blocks(self):
        return len(self.scheduler.running)

    def stats(self):
        running = self.scheduler.running
        return EngineStats(len(running), len(self.waiting), len(running) / 100, 100, 0, 0, 0, 0, self.generated)

    def step(self):
        self.in_step.set()
        self.gate.wait()
        self.in_step.clear()
        time.sleep(self.step_delay)
        running = self.scheduler.running
        while self.waiting and len(running) < self.max_running:
            running.append(self.waiting.popleft())
        if self.fail_next_steps:
            self.fail_next_steps -= 1
            raise RuntimeError("injected step failure")
        outs = []
        now = time.monotonic()
        for req in list(running):
            req.out.append(self.token)
            self.generated += 1
            req.first_token = req.first_token or now
            poison = "POISON" in self.tokenizer.decode(req.ids)
            reason = "error" if poison else ("length" if len(req.out) >= (req.params.max_tokens or 8) else None)
            if reason:
                running.remove(req)
                del self.requests[req.request_id]
            out = CompletionOutput(0, self.tokenizer.decode(req.out), list(req.out), reason)
            outs.append(RequestOutput(req.request_id, None, req.ids, [out], reason is not None,
                                      metrics=RequestMetrics(req.arrival, req.arrival, req.first_token,
                                                             now if reason else None)))
        return outs


@pytest.fixture
def fake(bundled_tokenizer):
    return FakeEngine(bundled_tokenizer)


def serve(engine, **config) -> ServerThread:
    config.setdefault("access_log", False)
    return ServerThread(build_app(engine, ServerConfig(**config)), shutdown_timeout=config.pop("shutdown", 10))


def completion(client: httpx.Client, prompt="hello", max_tokens=3, **extra) -> httpx.Response:
    return client.post("/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens, **extra})


def sse_events(resp: httpx.Response) -> list:
    return [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]


def wait_until(predicate, what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def test_health_answers_while_a_step_is_running(fake):
    fake.gate.clear()
    with serve(fake) as srv, httpx.Client(base_url=srv.url, timeout=30) as c:
        with c.stream("POST", "/v1/completions", json={"prompt": "hi", "max_tokens": 2, "stream": True}) as resp:
            assert fake.in_step.wait(10), "the engine never entered a step"
            assert c.get("/health").status_code == 200      # the worker is stuck inside step()
            fake.gate.set()
            events = sse_events(resp)
        assert events[-1] == "[DONE]"


def test_request_that_fails_in_engine_gets_500_and_others_complete(fake):
    with serve(fake) as srv, httpx.Client(base_url=srv.url, timeout=30) as c:
        results = {}

        def run(name, prompt):
            results[name] = completion(c, prompt, max_tokens=5)

        threads = [threading.Thread(target=run, args=(n, p)) for n, p in [("ok", "fine"), ("bad", "POISON pill")]]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert results["bad"].status_code == 500
        assert results["bad"].json()["error"]["type"] == "internal_error"
        assert results["ok"].status_code == 200
        assert results["ok"].json()["choices"][0]["finish_reason"] == "length"
        assert c.get("/health").status_code == 200


def test_step_failure_fails_its_requests_and_later_requests_succeed(fake):
    with serve(fake) as srv, httpx.Client(base_url=srv.url, timeout=30) as c:
        fake.fail_next_steps = 1
        failed = completion(c)
        assert failed.status_code == 500 and "injected step failure" in failed.json()["error"]["message"]
        assert fake.scheduler.running == [] and not fake.requests
        assert completion(c).status_code == 200
        assert c.get("/health").status_code == 200


def test_engine_that_keeps_failing_is_dead_and_health_says_503(fake):
    with serve(fake) as srv, httpx.Client(base_url=srv.url, timeout=30) as c:
        fake.fail_next_steps = 1000
        for _ in range(3):
            r = completion(c)
            assert r.status_code in (500, 503) and "error" in r.json()
        wait_until(lambda: c.get("/health").status_code == 503, "/health to report the dead engine")
        assert c.get("/health").json()["error"]["code"] == "engine_dead"
        r = completion(c)
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"


def test_full_waiting_queue_sheds_load_with_429(fake):
    fake.max_running, fake.step_delay = 1, 0.01    # the first request runs for long; the rest wait
    with serve(fake, max_waiting_requests=2) as srv, httpx.Client(base_url=srv.url, timeout=30) as c:
        body = {"prompt": "hi", "max_tokens": 250, "stream": True}
        opened = [c.send(c.build_request("POST", "/v1/completions", json=body), stream=True) for _ in range(3)]
        assert [r.status_code for r in opened] == [200, 200, 200]   # one running, two waiting
        shed = completion(c)
        assert shed.status_code == 429
        assert shed.json()["error"]["type"] == "rate_limit_error" and shed.headers["retry-after"]
        for r in opened:
            r.close()
        wait_until(lambda: not fake.requests, "the closed streams to be aborted")
        assert completion(c).status_code == 200


def test_stream_disconnect_aborts_the_request(fake):
    fake.step_delay = 0.01
    with serve(fake) as srv, httpx.Client(base_url=srv.url, timeout=30) as c:
        with c.stream("POST", "/v1/completions", json={"prompt": "hi", "max_tokens": 250, "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    break                      # one chunk, then hang up
        wait_until(lambda: fake.aborted, "the request to be aborted")
        wait_until(lambda: fake.num_used_blocks() == 0 and not fake.requests, "its blocks to be freed")


def test_non_streaming_disconnect_aborts_the_request(fake):
    fake.step_delay = 0.01
    with serve(fake) as srv:
        def call():
            with httpx.Client(base_url=srv.url, timeout=0.5) as c, pytest.raises(httpx.ReadTimeout):
                completion(c, max_tokens=250)   # the client gives up after 0.5 s and closes
        call()
        wait_until(lambda: fake.aborted, "the request to be aborted")
        assert not fake.requests


def test_drain_lets_inflight_stream_finish_and_refuses_new_connections(fake):
    fake.step_delay = 0.02
    srv = serve(fake).start()
    with httpx.Client(base_url=srv.url, timeout=30) as c:
        with c.stream("POST", "/v1/completions", json={"prompt": "hi", "max_tokens": 20, "stream": True}) as r:
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            srv.drain()                                       # what SIGTERM does
            rest = [line[6:] for line in lines if line.startswith("data: ")]
        assert rest[-1] == "[DONE]"
        final = json.loads(rest[-2])
        assert final["choices"][0]["finish_reason"] == "length"
    srv.thread.join(20)
    assert not srv.thread.is_alive()
    with pytest.raises(httpx.ConnectError), httpx.Client(base_url=srv.url, timeout=5) as c2:
        c2.get("/health")
    assert fake.aborted == []


def test_drain_timeout_aborts_what_is_left(fake):
    fake.step_delay = 0.01
    srv = ServerThread(build_app(fake, ServerConfig(access_log=False)), shutdown_timeout=0.5).start()
    with httpx.Client(base_url=srv.url, timeout=30) as c:
        with c.stream("POST", "/v1/completions", json={"prompt": "hi", "max_tokens": 250, "stream": True}) as r:
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            srv.drain()
            with pytest.raises(httpx.HTTPError):
                for _ in lines:
                    pass
    srv.thread.join(20)
    assert not srv.thread.is_alive()
    assert len(fake.aborted) == 1 and not fake.requests


@pytest.mark.parametrize("headers,status", [
    ({}, 401),
    ({"Authorization": "Bearer wrong-key"}, 401),
    ({"Authorization": "Basic secret-key"}, 401),
    ({"Authorization": "Bearer secret-key"}, 200),
])
def test_api_key_is_required_on_v1_routes(fake, headers, status):
    with serve(fake, api_keys=["secret-key"]) as srv, httpx.Client(base_url=srv.url, timeout=30) as c:
        r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}, headers=headers)
        assert r.status_code == status
        if status == 401:
            assert r.json()["error"]["type"] == "authentication_error"
        assert c.get("/health").status_code == 200            # probes need no key
        assert c.get("/metrics").status_code == 200


def test_oversized_body_gets_413_with_and_without_content_length(fake):
    with serve(fake, max_body_bytes=2048) as srv, httpx.Client(base_url=srv.url, timeout=30) as c:
        big = json.dumps({"prompt": "x" * 5000, "max_tokens": 1}).encode()
        r = c.post("/v1/completions", content=big, headers={"content-type": "application/json"})
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
        chunked = c.post("/v1/completions", content=iter([big[:1000], big[1000:]]))   # no Content-Length
        assert chunked.status_code == 413
        assert completion(c).status_code == 200


def test_slow_reader_gets_the_newest_output_then_the_end():
    import asyncio

    from tokenfab.engine.async_engine import RequestFailed, RequestStream

    def output(n: int, finished: bool) -> RequestOutput:
        return RequestOutput("r", None, [1], [CompletionOutput(0, "a" * n, [5] * n, "length" if finished else None)],
                             finished)

    async def read_all(stream) -> list:
        seen = []
        try:
            async for out in stream:
                seen.append(len(out.outputs[0].token_ids))
        except RequestFailed as e:
            seen.append(str(e))
        return seen

    async def main():
        owner = SimpleNamespace(abort=lambda rid: None)
        done = RequestStream("r", owner)
        for n in range(1, 6):                 # five steps arrive before the reader looks
            done._put(output(n, finished=n == 5))
        failed = RequestStream("r", owner)
        failed._put(output(1, False))
        failed._put(RequestFailed("boom"))
        return await read_all(done), await read_all(failed)

    assert asyncio.run(main()) == ([5], [1, "boom"])


@pytest.mark.skipif(len(__import__("os").sched_getaffinity(0)) < 2, reason="needs 2 cores to tell the counts apart")
def test_small_steps_run_on_small_batch_threads_and_big_ones_on_all(bundled_files):
    import asyncio

    import torch

    from tokenfab import LLM, SamplingParams
    from tokenfab.config import DEFAULT_SMALL_BATCH_TOKENS as SMALL_BATCH
    from tokenfab.engine.async_engine import AsyncEngine

    full = 2
    torch.set_num_threads(full)     # an earlier test may have left another count, in this thread or another
    llm = LLM(loaded=bundled_files, max_model_len=256, num_kv_blocks=128, small_batch_threads=1)
    assert llm.engine.thread_controller is None      # one owner of the thread count
    seen: list[tuple[int, int, int]] = []     # (sequences, tokens, threads) per step
    llm.engine.step_observer = lambda steps, start, end, busy: seen.append(
        (len(steps), sum(n for _, n in steps), torch.get_num_threads()))
    eng = AsyncEngine(llm.engine)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)

    async def run(n: int, prompt_len: int = 4) -> None:
        streams = await asyncio.gather(*(eng.add_request(f"r{n}-{prompt_len}-{i}", [5] * (prompt_len - 1) + [i + 8],
                                                         params) for i in range(n)))
        for s in streams:
            async for _ in s:
                pass

    async def main() -> None:
        eng.start()
        await run(1)
        await run(1, prompt_len=32)            # one sequence, but its prefill is a big step
        await run(SMALL_BATCH + 4)
        await eng.stop()

    asyncio.run(main())
    assert all(t == 1 for n, tok, t in seen if tok <= SMALL_BATCH)
    assert [t for n, tok, t in seen if n == 1 and tok == 32] == [full]
    assert any(t == full for n, tok, t in seen if n > SMALL_BATCH)
    assert torch.get_num_threads() == full          # the caller's setting is untouched


def test_a_replica_lost_under_a_request_is_a_503_to_retry_and_an_engine_failure_a_500():
    from tokenfab.engine.client import EngineDeadError, ReplicaLost, RequestFailed
    from tokenfab.server.state import engine_error

    lost = engine_error(ReplicaLost("replica r1 failed while streaming this request"))
    assert (lost.status, lost.code, lost.headers) == (503, "replica_lost", {"Retry-After": "1"})
    assert "replica r1" in lost.message
    assert engine_error(RequestFailed("boom")).status == 500
    assert engine_error(EngineDeadError("gone")).status == 503

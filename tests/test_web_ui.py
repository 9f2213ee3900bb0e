"""The web page at `/` in headless Chromium against a real `tokenfab serve`: chat streaming, stop
aborting on the server, the live dashboard, the bench viewer, the doctor card, and the API key.

Needs Debian's `chromium` and the `playwright` package (test extra); skipped with the reason otherwise
(`make test` installs chromium). Screenshots go to out/ui/ (git-ignored) as test artifacts.
"""
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import threading
import time

import httpx
import pytest

from tests.serve_process import serve

ARTIFACTS = pathlib.Path(__file__).resolve().parent.parent / "out" / "ui"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
# One thread per server: the test machine is shared, and two torch pools thrash on 2 cores.
SERVER_FLAGS = ("--max-num-seqs", "4", "--max-model-len", "512", "--num-threads", "1")


def _chromium() -> str | None:
    for path in (os.environ.get("TOKENFAB_CHROMIUM"), shutil.which("chromium"), shutil.which("chromium-browser"),
                 "/usr/bin/chromium"):
        if path and os.path.exists(path):
            return path
    return None


playwright_api = pytest.importorskip("playwright.sync_api", reason="the `playwright` package is not installed "
                                     "(pip install -e '.[test]'); browser tests skipped")
if _chromium() is None:
    pytest.skip("no chromium found (apt-get install chromium, or set TOKENFAB_CHROMIUM); browser tests skipped",
                allow_module_level=True)


@pytest.fixture(scope="module")
def browser():
    with playwright_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=_chromium(), args=CHROMIUM_ARGS)
        yield b
        b.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with serve(tmp_path_factory.mktemp("ui") / "serve.log", *SERVER_FLAGS) as url:
        yield url


@pytest.fixture()
def page(browser, server, request):
    ctx = browser.new_context(viewport={"width": 1280, "height": 900})
    pg = ctx.new_page()
    pg.errors = []
    pg.outside = []
    pg.on("pageerror", lambda e: pg.errors.append(str(e)))
    pg.on("request", lambda r: None if r.url.startswith((server, "data:")) else pg.outside.append(r.url))
    yield pg
    shot(pg, request.node.name + "-end")
    ctx.close()
    assert pg.errors == [], pg.errors
    assert pg.outside == [], f"the page fetched from outside the server: {pg.outside}"


def shot(pg, name: str) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / f"{name}.png"
    pg.screenshot(path=str(path), full_page=True)
    print(f"screenshot: {path}")


def metric(url: str, name: str, **labels) -> float:
    text = httpx.get(f"{url}/metrics", trust_env=False).text
    total = 0.0
    for m in re.finditer(rf"^tokenfab:{re.escape(name)}\{{([^}}]*)\}} (\S+)$", text, re.M):
        if all(f'{k}="{v}"' in m.group(1) for k, v in labels.items()):
            total += float(m.group(2))
    return total


def wait_idle(url: str, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while metric(url, "num_requests_running") + metric(url, "num_requests_waiting") > 0:
        assert time.monotonic() < deadline, "the server still runs requests"
        time.sleep(0.2)
    assert metric(url, "kv_cache_usage_perc") == 0.0


def chat(pg, text: str, max_tokens: int = 24) -> None:
    pg.fill("#chat-max_tokens", str(max_tokens))
    pg.fill("#chat-temperature", "0")
    pg.fill("#chat-input", text)
    pg.click("#chat-send")


def test_page_loads_offline_with_the_model_name(page, server):
    page.goto(server + "/")
    page.wait_for_function("document.querySelector('#model-name').textContent.includes('SmolLM2')")
    assert page.evaluate("typeof uPlot") == "function"          # the vendored chart library loaded
    assert page.is_hidden("#key-box")
    shot(page, "load")


def test_chat_streams_a_reply_with_ttft_and_tok_s_under_it(page, server):
    page.goto(server + "/")
    page.wait_for_function("document.querySelector('#model-name').textContent.length > 0")
    chat(page, "Name three colors.", max_tokens=24)
    # Streamed: text shows while the request is still running (the Stop button is live).
    page.wait_for_function("document.querySelector('.msg.assistant .text').textContent.length > 0 && "
                           "!document.querySelector('#chat-stop').disabled", timeout=120_000)
    page.wait_for_function("window.tf.timings.length === 1", timeout=120_000)
    t = page.evaluate("window.tf.timings[0]")
    reply = page.inner_text(".msg.assistant .text")
    meta = page.inner_text(".msg.assistant .meta")
    shot(page, "chat")
    assert reply.strip() and "error" not in t
    assert t["tokens"] > 1 and t["firstPaint"] >= t["firstChunk"] >= t["send"]
    assert "TTFT" in meta and "tok/s" in meta
    # For the report: the API's TTFT (httpx) on a prompt of the same length that the prefix cache has not
    # seen, beside the page's send -> first chunk -> first painted frame, the two alternating.
    wait_idle(server)
    rows = []
    for i, (word, ui_word) in enumerate((("fruits", "animals"), ("trees", "rivers"))):
        api = _api_ttft_ms(server, f"Name three {word}.")
        chat(page, f"Name three {ui_word}.", max_tokens=8)
        page.wait_for_function(f"window.tf.timings.length === {i + 2}", timeout=120_000)
        u = page.evaluate(f"window.tf.timings[{i + 1}]")
        rows.append((api, u["firstChunk"] - u["send"], u["firstPaint"] - u["send"]))
    for api, chunk, paint in rows:
        print(f"TTFT: API (httpx) {api:.1f} ms | page: first chunk {chunk:.1f} ms, first paint {paint:.1f} ms")
    wait_idle(server)


def _api_ttft_ms(url: str, text: str) -> float:
    body = {"messages": [{"role": "user", "content": text}], "max_tokens": 8, "temperature": 0, "stream": True}
    t0 = time.perf_counter()
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120, trust_env=False) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                d = json.loads(line[6:])
                if d["choices"] and d["choices"][0]["delta"].get("content"):
                    return (time.perf_counter() - t0) * 1e3
    raise AssertionError("no content chunk")


def test_stop_mid_stream_aborts_the_request_on_the_server(page, server):
    page.goto(server + "/")
    page.wait_for_function("document.querySelector('#model-name').textContent.length > 0")
    aborted = metric(server, "request_success_total", finished_reason="abort")
    chat(page, "Write a long story about a lighthouse keeper.", max_tokens=400)
    page.wait_for_function("document.querySelector('.msg.assistant .text').textContent.length > 0", timeout=120_000)
    page.click("#chat-stop")
    page.wait_for_function("window.tf.timings.length === 1 && window.tf.timings[0].aborted", timeout=30_000)
    deadline = time.monotonic() + 30
    while metric(server, "request_success_total", finished_reason="abort") == aborted:
        assert time.monotonic() < deadline, "stop did not abort the request on the server"
        time.sleep(0.2)
    assert "stopped" in page.inner_text(".msg.assistant .meta")
    shot(page, "stopped")
    wait_idle(server)


def test_dashboard_numbers_change_under_load_and_the_doctor_card_answers(page, server):
    page.goto(server + "/")
    page.click("button[data-tab=dash]")
    page.wait_for_function("window.tf.dash.samples >= 2")
    gen0 = page.evaluate("window.tf.dash.finished")
    stop = threading.Event()

    def load():
        with httpx.Client(timeout=120, trust_env=False) as c:
            while not stop.is_set():
                c.post(f"{server}/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 16,
                                                         "ignore_eos": True})
    threads = [threading.Thread(target=load, daemon=True) for _ in range(2)]
    for th in threads:
        th.start()
    try:
        page.wait_for_function("window.tf.dash.running > 0", timeout=60_000)
        page.wait_for_function(f"window.tf.dash.genTokS > 0 && window.tf.dash.finished > {gen0}", timeout=120_000)
        page.wait_for_function("window.tf.dash.ttftP50 !== null && window.tf.dash.tpotP50 !== null", timeout=60_000)
        page.click("#doctor-run")
        page.wait_for_function("window.tf.doctor !== null", timeout=60_000)
        shot(page, "dashboard")
    finally:
        stop.set()
        for th in threads:
            th.join(timeout=120)
    doc = page.evaluate("window.tf.doctor")
    assert doc["measured"]["generation_tok_s"] > 0
    assert page.locator("#doctor-out").inner_text().strip()
    assert page.locator("#dash-charts canvas").count() == 4
    wait_idle(server)


def test_bench_viewer_plots_a_bench_result(page, server, tmp_path):
    out = tmp_path / "result.json"
    # A subprocess: Playwright's sync API holds this thread's event loop, and bench runs its own.
    subprocess.run([sys.executable, "-m", "tokenfab", "bench", "serve", "--base-url", server, "--num-prompts", "6",
                    "--input-len", "24", "--output-len", "4", "--max-concurrency", "2", "--buckets", "16,32",
                    "--no-progress", "--out", str(out)], check=True, timeout=300, capture_output=True)
    page.goto(server + "/")
    page.click("button[data-tab=bench]")
    page.set_input_files("#bench-file", str(out))
    page.wait_for_function("document.querySelectorAll('#bench-charts canvas').length > 0")
    titles = page.locator("#bench-charts .u-title").all_inner_texts()
    shot(page, "bench")
    assert [t for t in titles if "CDF" in t] == ["TTFT CDF (ms)", "TPOT CDF (ms)", "ITL CDF (ms)", "E2E latency CDF (ms)"]
    assert sum("P50 / P99 by prompt length" in t for t in titles) == 3
    assert "6 ok" in page.inner_text("#bench-summary")
    # A file that is not a bench result is refused with a message, not a broken page.
    bad = tmp_path / "bad.json"
    bad.write_text('{"schema": "something else"}')
    page.set_input_files("#bench-file", str(bad))
    page.wait_for_function("document.querySelector('#banner').textContent.includes('not a')")


def test_api_key_page_gets_401_without_the_key_and_works_with_it(browser, tmp_path):
    with serve(tmp_path / "serve.log", *SERVER_FLAGS, "--api-key", "sesame") as url:
        assert httpx.get(f"{url}/", trust_env=False).status_code == 200           # the page needs no key
        assert httpx.get(f"{url}/ui/app.js", trust_env=False).status_code == 200
        assert "sesame" not in httpx.get(f"{url}/", trust_env=False).text
        ctx = browser.new_context(viewport={"width": 1280, "height": 900})
        pg = ctx.new_page()
        statuses = []
        pg.on("response", lambda r: statuses.append((r.url.removeprefix(url), r.status)))
        try:
            pg.goto(url + "/")
            pg.wait_for_selector("#key-box:not([hidden])")
            assert "needs an API key" in pg.inner_text("#banner")
            chat(pg, "Hi", max_tokens=4)
            pg.wait_for_function("window.tf.timings.length === 1")
            assert pg.evaluate("window.tf.timings[0].status") == 401
            assert ("/v1/chat/completions", 401) in statuses and ("/v1/models", 401) in statuses
            shot(pg, "api-key-missing")
            pg.fill("#api-key", "sesame")
            pg.click("#key-save")
            pg.wait_for_function("document.querySelector('#model-name').textContent.includes('SmolLM2')")
            assert pg.is_hidden("#banner")
            chat(pg, "Hi", max_tokens=4)
            pg.wait_for_function("window.tf.timings.length === 2", timeout=120_000)
            assert pg.evaluate("window.tf.timings[1].error") is None
            assert ("/v1/chat/completions", 200) in statuses
            shot(pg, "api-key-given")
        finally:
            ctx.close()

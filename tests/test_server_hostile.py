"""Hostile request bodies on purpose, beside the generated fuzz (test_server_fuzz.py): bodies nested 10,000
levels deep, invalid UTF-8 and lone surrogates, huge arrays, numbers beyond 64 bits, duplicate keys, a
Content-Length that lies, a slow body, and upload names with path characters. Each gets a 4xx in the API's
own error body, or a safe outcome (a normal answer); never a 5xx, a hang or a leaked KV block."""
from __future__ import annotations

import json
import os
import socket
import time

import httpx
import pytest

from tests.oracle import make_tiny_model
from tokenfab import LLM
from tokenfab.server.app import build_app
from tokenfab.server.config import ServerConfig
from tokenfab.server.launch import ServerThread

pytestmark = pytest.mark.timeout(300)
DEEP = 10_000
MSG = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory, bundled_tokenizer):
    folder = tmp_path_factory.mktemp("hostile-llama")
    make_tiny_model("llama", str(folder), bundled_tokenizer)
    data = tmp_path_factory.mktemp("hostile-data")
    llm = LLM(model=str(folder), max_model_len=128, num_kv_blocks=128, block_size=16)
    app = build_app(llm.engine, ServerConfig(access_log=False, max_n=4, max_request_sequences=8,
                                             served_model_names=["tiny"], data_dir=str(data)))
    with ServerThread(app) as srv:
        yield srv.url, str(data)
    assert llm.engine.block_manager.num_used_blocks() == 0


def _deep_array() -> str:
    return "[" * DEEP + "]" * DEEP


def _deep_object() -> str:
    return '{"a":' * DEEP + "1" + "}" * DEEP


def _deep_schema() -> str:
    return '{"type":"object","properties":{"a":' * DEEP + '{"type":"string"}' + "}}" * DEEP


def _raw(route: str, fields: str) -> tuple[str, bytes]:
    return route, ("{" + fields + "}").encode()


CHAT = '"model":"tiny","max_tokens":2,'
CASES = {
    # nesting
    "deep array as messages": _raw("/v1/chat/completions", CHAT + '"messages":' + _deep_array()),
    "deep object in a message": _raw("/v1/chat/completions", CHAT + '"messages":[{"role":"user","content":'
                                     + _deep_object() + "}]"),
    "deep JSON schema": _raw("/v1/chat/completions", CHAT + '"messages":' + json.dumps(MSG) + ','
                             '"response_format":{"type":"json_schema","json_schema":{"name":"x","schema":'
                             + _deep_schema() + "}}"),
    "deep tool parameters": _raw("/v1/chat/completions", CHAT + '"messages":' + json.dumps(MSG) + ','
                                 '"tools":[{"type":"function","function":{"name":"f","parameters":'
                                 + _deep_schema() + "}}]"),
    "deep prompt": _raw("/v1/completions", '"model":"tiny","max_tokens":2,"prompt":' + _deep_array()),
    "deep metadata": _raw("/v1/batches", '"input_file_id":"file-x","endpoint":"/v1/completions",'
                          '"completion_window":"24h","metadata":' + _deep_object()),
    "deep tokenize body": _raw("/tokenize", '"model":"tiny","prompt":' + _deep_array()),
    # encodings
    "invalid UTF-8": ("/v1/chat/completions", b'{"model":"tiny","max_tokens":2,"messages":[{"role":"user",'
                      b'"content":"\xff\xfe\xc0"}]}'),
    "lone surrogate in a message": _raw("/v1/chat/completions", CHAT + '"messages":[{"role":"user",'
                                        '"content":"a\\ud800b"}]'),
    "lone surrogate in a prompt": _raw("/v1/completions", '"model":"tiny","max_tokens":2,"prompt":"\\udfff"'),
    "lone surrogate in stop": _raw("/v1/completions", '"model":"tiny","max_tokens":2,"prompt":"hi",'
                                   '"stop":["\\ud800"]'),
    "lone surrogate in a tool name": _raw("/v1/chat/completions", CHAT + '"messages":' + json.dumps(MSG) + ','
                                          '"tools":[{"type":"function","function":{"name":"\\ud800"}}]'),
    # sizes
    "huge logit_bias": _raw("/v1/completions", '"model":"tiny","max_tokens":2,"prompt":"hi","logit_bias":'
                            + json.dumps({str(i): 1 for i in range(5_000)})),
    "huge stop": _raw("/v1/completions", '"model":"tiny","max_tokens":2,"prompt":"hi","stop":'
                      + json.dumps(["x"] * 5_000)),
    "huge messages": _raw("/v1/chat/completions", CHAT + '"messages":' + json.dumps(MSG * 20_000)),
    "huge tools": _raw("/v1/chat/completions", CHAT + '"messages":' + json.dumps(MSG) + ',"tools":'
                       + json.dumps([{"type": "function", "function": {"name": f"f{i}"}} for i in range(5_000)])),
    "huge prompt token array": _raw("/v1/completions", '"model":"tiny","max_tokens":2,"prompt":'
                                    + json.dumps(list(range(1000)) * 20)),
    # numbers
    "max_tokens beyond 64 bits": _raw("/v1/completions", '"model":"tiny","prompt":"hi","max_tokens":'
                                      + str(2 ** 80)),
    "max_tokens 1e400": _raw("/v1/completions", '"model":"tiny","prompt":"hi","max_tokens":1e400'),
    "seed beyond 64 bits": _raw("/v1/completions", '"model":"tiny","prompt":"hi","max_tokens":2,"seed":'
                                + str(-2 ** 70)),
    "temperature 1e309": _raw("/v1/chat/completions", CHAT + '"messages":' + json.dumps(MSG) + ',"temperature":1e309'),
    "logit_bias value 1e400": _raw("/v1/completions", '"model":"tiny","max_tokens":2,"prompt":"hi",'
                                   '"logit_bias":{"5":1e400}'),
    "logit_bias key beyond 64 bits": _raw("/v1/completions", '"model":"tiny","max_tokens":2,"prompt":"hi",'
                                          '"logit_bias":{"' + str(2 ** 70) + '":1}'),
    "prompt token beyond 64 bits": _raw("/v1/completions", '"model":"tiny","max_tokens":2,"prompt":[' + str(2 ** 70) + "]"),
    "n beyond 64 bits": _raw("/v1/completions", '"model":"tiny","max_tokens":2,"prompt":"hi","n":' + str(2 ** 65)),
    "top_logprobs beyond 64 bits": _raw("/v1/chat/completions", CHAT + '"messages":' + json.dumps(MSG) +
                                        ',"logprobs":true,"top_logprobs":' + str(2 ** 65)),
    "a 1e5-digit number": _raw("/v1/completions", '"model":"tiny","prompt":"hi","max_tokens":' + "9" * 100_000),
    "NaN and Infinity literals": _raw("/v1/completions", '"model":"tiny","prompt":"hi","max_tokens":2,'
                                      '"temperature":NaN,"top_p":Infinity'),
}
# safe outcomes: a normal answer is right for these
MAY_SUCCEED = {"huge logit_bias"}


def _check_4xx(r: httpx.Response, name: str) -> None:
    assert 400 <= r.status_code < 500, (name, r.status_code, r.text[:300])
    err = r.json()["error"]
    assert err["message"] and err["type"], (name, err)


@pytest.mark.parametrize("name", list(CASES))
def test_each_hostile_body_gets_a_4xx_in_the_apis_error_body_or_a_safe_answer(server, name):
    url, _ = server
    route, body = CASES[name]
    r = httpx.post(url + route, content=body, headers={"content-type": "application/json"}, timeout=120)
    if name in MAY_SUCCEED and r.status_code == 200:
        r.json()
        return
    _check_4xx(r, name)


def test_duplicate_keys_take_the_last_value_as_json_does(server):
    url, _ = server
    body = b'{"model":"tiny","prompt":"hi","max_tokens":50,"max_tokens":1}'
    r = httpx.post(url + "/v1/completions", content=body, headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 1


def _raw_http(url: str, request: bytes, pause: float = 0.0, chunks: list[bytes] = (), half_close: bool = True) -> bytes:
    host, port = url.split("//")[1].split(":")
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(request)
        for c in chunks:
            time.sleep(pause)
            s.sendall(c)
        if half_close:        # the client stops sending (uvicorn may read that as a disconnect)
            s.shutdown(socket.SHUT_WR)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
        return out


def _status(raw: bytes) -> int:
    return int(raw.split(b" ", 2)[1]) if raw else 0


def test_a_content_length_that_lies_gets_a_4xx_or_nothing_never_a_5xx_or_a_hang(server):
    url, _ = server
    body = b'{"model":"tiny","prompt":"hi","max_tokens":1}'
    # shorter than the body: the server reads a truncated JSON document
    short = _raw_http(url, b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                      b"content-length: 10\r\nconnection: close\r\n\r\n" + body)
    assert 400 <= _status(short) < 500, short[:300]
    # longer than the body, then the client stops sending: the connection ends without an answer or with a 4xx
    t0 = time.monotonic()
    long = _raw_http(url, b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                     b"content-length: 1000\r\nconnection: close\r\n\r\n" + body)
    assert _status(long) == 0 or 400 <= _status(long) < 500, long[:300]
    assert time.monotonic() - t0 < 30
    # and the server still answers
    assert httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 1},
                      timeout=60).status_code == 200


def test_a_slow_body_is_answered_normally(server):
    url, _ = server
    body = b'{"model":"tiny","prompt":"hi","max_tokens":1}'
    head = (b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\nconnection: close\r\n\r\n" % len(body))
    raw = _raw_http(url, head, pause=0.2, chunks=[body[i:i + 8] for i in range(0, len(body), 8)], half_close=False)
    assert _status(raw) == 200, raw[:300]


@pytest.mark.parametrize("filename", ["../../../etc/passwd", "/abs/path.jsonl", "a\\..\\b.jsonl", "..", "x/../../y.jsonl"])
def test_upload_names_with_path_characters_stay_inside_the_data_dir(server, filename):
    url, data = server
    line = json.dumps({"custom_id": "1", "method": "POST", "url": "/v1/completions",
                       "body": {"model": "tiny", "prompt": "hi", "max_tokens": 1}}) + "\n"
    before = {os.path.join(d, f) for d, _, fs in os.walk(os.path.dirname(data)) for f in fs}
    r = httpx.post(url + "/v1/files", data={"purpose": "batch"},
                   files={"file": (filename, line.encode(), "application/jsonl")}, timeout=60)
    if r.status_code == 200:
        got = r.json()
        assert httpx.get(url + f"/v1/files/{got['id']}/content", timeout=60).content == line.encode()
    else:
        _check_4xx(r, filename)
    after = {os.path.join(d, f) for d, _, fs in os.walk(os.path.dirname(data)) for f in fs}
    assert all(os.path.realpath(p).startswith(os.path.realpath(data)) for p in after - before), after - before
    assert not os.path.exists("/abs/path.jsonl")

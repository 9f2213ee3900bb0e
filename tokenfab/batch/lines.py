"""A batch input file's lines, and the output lines they become (OpenAI's and vLLM's run_batch format).

Input, one JSON object per line:
    {"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions", "body": {...}}
Output, one per input line:
    {"id": "batch_req_...", "custom_id": "r1", "response": {"status_code", "request_id", "body"}, "error": null}
A line that cannot run (bad JSON, a missing field, another endpoint, a repeated custom_id) becomes an
error line `{"id", "custom_id", "response": null, "error": {"code", "message", "line"}}` and the rest
run. Line numbers count from 1, as an editor shows them.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

ENDPOINTS = ("/v1/chat/completions", "/v1/completions")
MAX_CUSTOM_ID = 512


@dataclass(slots=True)
class BatchLine:
    line: int
    custom_id: str
    url: str
    body: dict


@dataclass(slots=True)
class LineError:
    line: int
    custom_id: str | None
    code: str
    message: str


def parse_lines(data: bytes, endpoint: str | None = None) -> tuple[list[BatchLine], list[LineError]]:
    """Every non-blank line, as a runnable BatchLine or a LineError. `endpoint`: the batch's endpoint,
    which every line's url must equal (None: either endpoint, as the offline runner allows)."""
    ok: list[BatchLine] = []
    bad: list[LineError] = []
    seen: set[str] = set()
    for n, raw in enumerate(data.split(b"\n"), start=1):
        if not raw.strip():
            continue
        err = _check(n, raw, endpoint, seen)
        if isinstance(err, LineError):
            bad.append(err)
        else:
            ok.append(err)
            seen.add(err.custom_id)
    return ok, bad


def _check(n: int, raw: bytes, endpoint: str | None, seen: set[str]) -> BatchLine | LineError:
    try:
        obj = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        return LineError(n, None, "invalid_json", f"line {n} is not valid JSON: {e}")
    if not isinstance(obj, dict):
        return LineError(n, None, "invalid_json", f"line {n} must be a JSON object")
    cid = obj.get("custom_id")
    if not isinstance(cid, str) or not cid or len(cid) > MAX_CUSTOM_ID:
        return LineError(n, None, "missing_custom_id",
                         f"line {n}: custom_id must be a non-empty string of at most {MAX_CUSTOM_ID} characters")
    if cid in seen:
        return LineError(n, cid, "duplicate_custom_id", f"line {n}: custom_id {cid!r} was used by an earlier line")
    if obj.get("method", "POST") != "POST":
        return LineError(n, cid, "invalid_method", f"line {n}: method must be \"POST\"")
    url = obj.get("url")
    allowed = (endpoint,) if endpoint else ENDPOINTS
    if url not in allowed:
        return LineError(n, cid, "invalid_url", f"line {n}: url must be {' or '.join(allowed)}, got {url!r}")
    body = obj.get("body")
    if not isinstance(body, dict):
        return LineError(n, cid, "missing_body", f"line {n}: body must be a JSON object (the request)")
    if body.get("stream"):
        return LineError(n, cid, "invalid_body", f"line {n}: stream is not supported in a batch")
    return BatchLine(n, cid, url, body)


def result_line(custom_id: str, status: int, request_id: str | None, body: dict) -> dict:
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id,
            "response": {"status_code": status, "request_id": request_id, "body": body}, "error": None}


def error_line(err: LineError) -> dict:
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": err.custom_id, "response": None,
            "error": {"code": err.code, "message": err.message, "line": err.line}}


def is_error(record: dict) -> bool:
    """Whether an output line belongs in the error file: a line error, or a non-2xx response."""
    resp = record.get("response")
    return record.get("error") is not None or resp is None or not 200 <= resp.get("status_code", 500) < 300

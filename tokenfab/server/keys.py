"""API keys with per-key limits: a keys file, the checks, and the rate windows behind OpenAI's 429s.

`--api-keys-file FILE` is JSON: {"keys": [{"key": "...", "name": "team-a", "requests_per_minute": 60,
"tokens_per_minute": 20000, "max_tokens": 1024, "models": ["..."], "service_classes": ["interactive"]}]}.
Every field but `key` is optional (no limit); `name` labels the key in /metrics and logs, which never show
the key itself. `--api-key KEY` adds a key without limits.

Requests per minute are counted when a request is let in; tokens per minute (prompt plus generated, from
the request's own accounting) when it ends, so a request is refused once the last 60 s used up the
minute's tokens. A refusal is a 429 with `Retry-After` (seconds until the window has room) and the
`x-ratelimit-*` headers OpenAI's clients read; every keyed answer carries the headers.
"""
from __future__ import annotations

import collections
import json
import math
import time
from dataclasses import dataclass

WINDOW_S = 60.0


@dataclass(frozen=True)
class KeyPolicy:
    key: str
    name: str
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    max_tokens: int | None = None
    models: tuple[str, ...] | None = None
    service_classes: tuple[str, ...] | None = None


_FIELDS = {"key", "name", "requests_per_minute", "tokens_per_minute", "max_tokens", "models", "service_classes"}


def load_keys_file(path: str) -> list[KeyPolicy]:
    """The keys of a keys file; ValueError naming the file and what is wrong."""
    try:
        with open(path) as f:
            doc = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: cannot read the keys file ({e})") from None
    entries = doc.get("keys") if isinstance(doc, dict) else None
    if not isinstance(entries, list) or not entries:
        raise ValueError(f'{path}: expected {{"keys": [{{"key": "...", ...}}, ...]}} with at least one key')
    out, names = [], set()
    for i, e in enumerate(entries):
        where = f"{path}: keys[{i}]"
        if not isinstance(e, dict) or not isinstance(e.get("key"), str) or not e["key"]:
            raise ValueError(f"{where}: needs a non-empty string 'key'")
        unknown = set(e) - _FIELDS
        if unknown:
            raise ValueError(f"{where}: unknown field(s) {', '.join(sorted(unknown))}; known: {', '.join(sorted(_FIELDS))}")
        for f in ("requests_per_minute", "tokens_per_minute", "max_tokens"):
            v = e.get(f)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise ValueError(f"{where}: {f} must be a positive integer, got {v!r}")
        for f in ("models", "service_classes"):
            v = e.get(f)
            if v is not None and (not isinstance(v, list) or not all(isinstance(x, str) for x in v)):
                raise ValueError(f"{where}: {f} must be a list of strings")
        name = e.get("name") or f"key-{i + 1}"
        if name in names:
            raise ValueError(f"{where}: the name {name!r} is used twice")
        names.add(name)
        out.append(KeyPolicy(e["key"], name, e.get("requests_per_minute"), e.get("tokens_per_minute"),
                             e.get("max_tokens"), tuple(e["models"]) if e.get("models") is not None else None,
                             tuple(e["service_classes"]) if e.get("service_classes") is not None else None))
    return out


class _Window:
    """Amounts spent over the last WINDOW_S seconds."""

    def __init__(self) -> None:
        self.events: collections.deque[tuple[float, int]] = collections.deque()
        self.total = 0

    def used(self, now: float) -> int:
        while self.events and self.events[0][0] <= now - WINDOW_S:
            self.total -= self.events.popleft()[1]
        return self.total

    def add(self, now: float, amount: int) -> None:
        if amount > 0:
            self.events.append((now, amount))
            self.total += amount

    def reset_s(self, now: float, limit: int) -> float:
        """Seconds until usage falls below `limit` (0 if it is below)."""
        total = self.used(now)
        for t, amount in self.events:
            if total < limit:
                break
            total -= amount
            if total < limit:
                return max(0.0, t + WINDOW_S - now)
        return 0.0


class KeyLimiter:
    """Per key name: the request and token windows, and the counts /metrics shows."""

    def __init__(self, clock=time.monotonic) -> None:
        self.clock = clock
        self.requests: dict[str, _Window] = collections.defaultdict(_Window)
        self.tokens: dict[str, _Window] = collections.defaultdict(_Window)
        self.admitted: collections.Counter[str] = collections.Counter()
        self.limited: collections.Counter[str] = collections.Counter()
        self.tokens_total: collections.Counter[str] = collections.Counter()

    def admit(self, p: KeyPolicy) -> tuple[float | None, list[tuple[bytes, bytes]]]:
        """(None, headers) and the request is counted, or (seconds to wait, headers) for a 429."""
        now = self.clock()
        wait = 0.0
        for limit, window in ((p.requests_per_minute, self.requests[p.name]), (p.tokens_per_minute, self.tokens[p.name])):
            if limit is not None and window.used(now) >= limit:
                wait = max(wait, window.reset_s(now, limit))
        if wait > 0:
            self.limited[p.name] += 1
            return wait, self.headers(p)
        self.requests[p.name].add(now, 1)
        self.admitted[p.name] += 1
        return None, self.headers(p)

    def charge(self, p: KeyPolicy, tokens: int) -> None:
        self.tokens[p.name].add(self.clock(), tokens)
        self.tokens_total[p.name] += tokens

    def headers(self, p: KeyPolicy) -> list[tuple[bytes, bytes]]:
        now, out = self.clock(), []
        for kind, limit, window in (("requests", p.requests_per_minute, self.requests[p.name]),
                                    ("tokens", p.tokens_per_minute, self.tokens[p.name])):
            if limit is None:
                continue
            remaining = max(0, limit - window.used(now))
            reset = window.reset_s(now, limit) if remaining == 0 else 0.0
            out += [(f"x-ratelimit-limit-{kind}".encode(), str(limit).encode()),
                    (f"x-ratelimit-remaining-{kind}".encode(), str(remaining).encode()),
                    (f"x-ratelimit-reset-{kind}".encode(), f"{reset:.3f}s".encode())]
        return out


def retry_after(wait_s: float) -> list[tuple[bytes, bytes]]:
    """Retry-After in whole seconds (HTTP's form) and in milliseconds (what the openai client reads first)."""
    return [(b"retry-after", str(max(1, math.ceil(wait_s))).encode()),
            (b"retry-after-ms", str(max(1, math.ceil(wait_s * 1000))).encode())]

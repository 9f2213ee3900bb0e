"""Drift analysis of a soak (`tokenfab bench soak`): windows in, verdict out. Pure functions, no I/O.

A soak cuts its run into windows; each ends with the load stopped and the server idle, when its memory,
threads, descriptors and KV blocks are sampled (`WindowStats`). This module judges those windows:

- per window (`window_checks`): its error rate and 5xx count; its P99 TTFT and TPOT against the
  baseline window's (the first after warm-up); the KV blocks in use when idle against the count
  before the soak started (a block still held with nothing in flight is a leak); open descriptors and
  threads against the baseline window's.
- over the run (`judge`): the slope of the idle RSS, fitted over the windows after warm-up (MiB per
  hour); the blocks leaked by the end; the error rate and 5xx count of the whole run; and whether the
  last `consecutive` windows all hold. A process is validated by consecutive batches that hold, not by
  one good batch, so the run passes only when its last N windows do and the run-level checks pass too.

A check whose input was not measured (a server without `/metrics`, a window without a streamed
request) is reported with `passed=None` and judges nothing.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

MIB = 1 << 20


@dataclass(frozen=True, slots=True)
class Thresholds:
    """What a soak must hold; the CLI's `--max-*` flags map onto these fields."""
    max_rss_slope_mib_per_hour: float = 6.0    # 1 MiB per 10 minutes after warm-up
    max_p99_regression: float = 0.10           # last P99 TTFT and TPOT at most 10 % above the baseline's
    max_leaked_blocks: int = 0
    max_error_rate: float = 0.0                # failed / sent, intended client aborts not counted
    max_5xx: int = 0
    max_fd_growth: int = 16                    # open descriptors above the baseline window's
    max_thread_growth: int = 8                 # threads above the baseline window's
    warmup_windows: int = 1                    # windows before the baseline: not judged, not fitted
    consecutive: int = 3                       # the last N windows must all hold

    def validate(self, num_windows: int) -> None:
        """ValueError naming the setting to change."""
        for name in ("max_rss_slope_mib_per_hour", "max_p99_regression", "max_leaked_blocks", "max_error_rate",
                     "max_5xx", "max_fd_growth", "max_thread_growth", "warmup_windows"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} is {getattr(self, name)}; it must be 0 or more")
        if self.max_error_rate > 1:
            raise ValueError(f"max_error_rate is {self.max_error_rate}; it is a share of requests, 0 to 1")
        if self.consecutive < 1:
            raise ValueError(f"consecutive is {self.consecutive}; at least 1 window must hold")
        need = self.warmup_windows + max(self.consecutive, 2)
        if num_windows < need:
            raise ValueError(f"{num_windows} windows are too few: {self.warmup_windows} warm-up window(s) plus "
                             f"{max(self.consecutive, 2)} judged ones (the consecutive windows that must hold, "
                             f"and at least 2 to fit an RSS slope) need {need}; lengthen the duration or "
                             "shorten the window")


@dataclass(slots=True)
class WindowStats:
    """What drift needs of one window. Server figures are the idle sample at its end (None: not measured)."""
    index: int
    end_s: float                          # when the idle sample was taken, seconds since the soak started
    requests: int                         # sent, intended aborts included
    failed: int                           # failed for any reason other than the client's own abort
    errors: dict[str, int] = field(default_factory=dict)    # by status: "500", "429", "timeout", "transport"…
    p99_ttft_ms: float | None = None
    p99_tpot_ms: float | None = None
    rss_bytes: int | None = None
    threads: int | None = None
    open_fds: int | None = None
    kv_used_blocks: int | None = None
    kv_resident_bytes: int | None = None  # the KV pool's resident pages, where the server says

    @property
    def rss_outside_kv(self) -> int | None:
        """The RSS less the KV pool's resident pages: a KV pool that is reserved at start and written as its
        blocks are first used grows the RSS until it is all used once, which is no leak."""
        if self.rss_bytes is None:
            return None
        return self.rss_bytes - (self.kv_resident_bytes or 0)

    @property
    def num_5xx(self) -> int:
        return sum(n for status, n in self.errors.items() if status.isdigit() and 500 <= int(status) < 600)


@dataclass(slots=True)
class Check:
    name: str
    value: float | None                   # what was measured (None: not measured)
    limit: float
    passed: bool | None                   # None: not measured, so not judged
    detail: str = ""


@dataclass(slots=True)
class Verdict:
    passed: bool
    checks: list[Check]                   # over the run
    windows: list[list[Check]]            # per window; warm-up windows get an empty list
    holds: list[bool | None]              # per window: all its checks passed (None: a warm-up window)


def rss_slope_mib_per_hour(times_s: list[float], rss_bytes: list[int]) -> float | None:
    """Least-squares slope of RSS against time, in MiB per hour; None with fewer than 2 points."""
    if len(times_s) < 2 or len(set(times_s)) < 2:
        return None
    slope_bytes_per_s = np.polyfit(np.asarray(times_s, dtype=float), np.asarray(rss_bytes, dtype=float), 1)[0]
    return float(slope_bytes_per_s * 3600 / MIB)


def _at_most(name: str, value: float | None, limit: float, detail: str = "") -> Check:
    return Check(name, value, limit, None if value is None else value <= limit, detail)


def _regression(name: str, value: float | None, base: float | None, allowed: float) -> Check:
    """value / base − 1 against `allowed` (0.1 = 10 % slower)."""
    if value is None or base is None or base <= 0:
        return Check(name, None, allowed, None, "not measured in this window or the baseline")
    change = value / base - 1.0
    return Check(name, change, allowed, change <= allowed, f"{value:.1f} ms against {base:.1f} ms")


def _growth(name: str, value: int | None, base: int | None, allowed: int) -> Check:
    if value is None or base is None:
        return Check(name, None, allowed, None, "not measured")
    return Check(name, value - base, allowed, value - base <= allowed, f"{value} against {base}")


def window_checks(w: WindowStats, baseline: WindowStats, start_kv_blocks: int | None, th: Thresholds) -> list[Check]:
    """Whether one window holds, check by check."""
    rate = w.failed / w.requests if w.requests else None
    return [
        _at_most("error_rate", rate, th.max_error_rate, f"{w.failed} of {w.requests} failed"),
        _at_most("5xx", w.num_5xx, th.max_5xx),
        _regression("p99_ttft", w.p99_ttft_ms, baseline.p99_ttft_ms, th.max_p99_regression),
        _regression("p99_tpot", w.p99_tpot_ms, baseline.p99_tpot_ms, th.max_p99_regression),
        _growth("leaked_kv_blocks", w.kv_used_blocks, start_kv_blocks, th.max_leaked_blocks),
        _growth("fd_growth", w.open_fds, baseline.open_fds, th.max_fd_growth),
        _growth("thread_growth", w.threads, baseline.threads, th.max_thread_growth),
    ]


def _holds(checks: list[Check]) -> bool:
    return all(c.passed is not False for c in checks)


def judge(windows: list[WindowStats], start_kv_blocks: int | None, th: Thresholds) -> Verdict:
    """The verdict on a soak: `start_kv_blocks` is the blocks in use when idle before any load."""
    th.validate(len(windows))
    baseline, last = windows[th.warmup_windows], windows[-1]
    per_window: list[list[Check]] = []
    holds: list[bool | None] = []
    for i, w in enumerate(windows):
        checks = window_checks(w, baseline, start_kv_blocks, th) if i >= th.warmup_windows else []
        per_window.append(checks)
        holds.append(_holds(checks) if i >= th.warmup_windows else None)

    fitted = [w for w in windows[th.warmup_windows:] if w.rss_bytes is not None]
    slope = rss_slope_mib_per_hour([w.end_s for w in fitted], [w.rss_outside_kv for w in fitted])
    less_kv = " less the KV pool's resident pages" if any(w.kv_resident_bytes for w in fitted) else ""
    sent = sum(w.requests for w in windows)
    failed = sum(w.failed for w in windows)
    tail = holds[-th.consecutive:]
    run = [
        _at_most("rss_slope", slope, th.max_rss_slope_mib_per_hour,
                 f"fitted over the idle RSS{less_kv} of {len(fitted)} windows after warm-up"),
        _regression("p99_ttft", last.p99_ttft_ms, baseline.p99_ttft_ms, th.max_p99_regression),
        _regression("p99_tpot", last.p99_tpot_ms, baseline.p99_tpot_ms, th.max_p99_regression),
        _growth("leaked_kv_blocks", last.kv_used_blocks, start_kv_blocks, th.max_leaked_blocks),
        _at_most("error_rate", failed / sent if sent else None, th.max_error_rate, f"{failed} of {sent} failed"),
        _at_most("5xx", sum(w.num_5xx for w in windows), th.max_5xx),
        Check("consecutive_windows", sum(h is True for h in tail), th.consecutive, all(tail),
              f"the last {th.consecutive} windows must all hold"),
    ]
    return Verdict(passed=_holds(run), checks=run, windows=per_window, holds=holds)

"""The soak's drift analysis (bench/drift.py) on synthetic windows: each failure mode fails the verdict
for its own reason, and a steady server passes."""
import dataclasses

import pytest

from tokenfab.bench.drift import MIB, Thresholds, WindowStats, judge, rss_slope_mib_per_hour

WINDOW_S = 300.0


def steady(n: int = 6, **over) -> list[WindowStats]:
    """n five-minute windows of a server that holds: flat RSS, same latency, nothing leaked, no errors."""
    return [dataclasses.replace(WindowStats(index=i, end_s=(i + 1) * WINDOW_S, requests=100, failed=0,
                                            p99_ttft_ms=80.0, p99_tpot_ms=20.0, rss_bytes=900 * MIB, threads=12,
                                            open_fds=40, kv_used_blocks=0), **over)
            for i in range(n)]


def check(verdict, name: str):
    return next(c for c in verdict.checks if c.name == name)


def test_a_steady_server_passes_every_check():
    v = judge(steady(), start_kv_blocks=0, th=Thresholds())
    assert v.passed
    assert all(c.passed for c in v.checks), [c for c in v.checks if not c.passed]
    assert v.holds == [None, True, True, True, True, True]
    assert check(v, "rss_slope").value == pytest.approx(0.0, abs=1e-9)


def test_rss_noise_around_a_flat_line_passes():
    ws = steady()
    for w, wiggle in zip(ws, [0, 3, -2, 2, -3, 0]):          # ± 3 MiB, no trend
        w.rss_bytes += wiggle * MIB
    v = judge(ws, 0, Thresholds())
    assert check(v, "rss_slope").passed, check(v, "rss_slope")


def test_growing_rss_fails_the_slope_check():
    ws = steady()
    for w in ws:                                               # 2 MiB per 5-minute window = 24 MiB/hour
        w.rss_bytes += int(2 * MIB * w.index)
    v = judge(ws, 0, Thresholds())
    assert not v.passed
    assert check(v, "rss_slope").value == pytest.approx(24.0)
    assert check(v, "rss_slope").passed is False
    assert check(v, "leaked_kv_blocks").passed and check(v, "p99_ttft").passed


def test_rss_growth_that_is_the_kv_pool_being_used_once_is_not_a_leak_but_growth_beside_it_is():
    # a reserved pool's pages become resident as its blocks are first used: 200 MiB more per window
    ws = steady()
    for i, w in enumerate(ws):
        w.kv_resident_bytes = 200 * MIB * i
        w.rss_bytes += w.kv_resident_bytes
    v = judge(ws, 0, Thresholds())
    assert check(v, "rss_slope").passed and "KV pool" in check(v, "rss_slope").detail, check(v, "rss_slope")
    for i, w in enumerate(ws):                                # 3 MiB per window outside the pool
        w.rss_bytes += 3 * MIB * i
    assert not check(judge(ws, 0, Thresholds()), "rss_slope").passed


def test_warm_up_growth_is_not_fitted():
    ws = steady()
    ws[0].rss_bytes = 500 * MIB                                # the first window loads caches: not a leak
    assert judge(ws, 0, Thresholds()).passed
    assert not judge(ws, 0, Thresholds(warmup_windows=0)).passed


def test_slope_is_a_least_squares_fit_in_mib_per_hour():
    assert rss_slope_mib_per_hour([0, 1800, 3600], [0, 5 * MIB, 10 * MIB]) == pytest.approx(10.0)
    assert rss_slope_mib_per_hour([60.0], [MIB]) is None


def test_leaked_kv_blocks_fail():
    ws = steady()
    ws[-1].kv_used_blocks = 3
    v = judge(ws, start_kv_blocks=0, th=Thresholds())
    assert not v.passed
    leak = check(v, "leaked_kv_blocks")
    assert leak.value == 3 and leak.passed is False
    assert v.holds[-1] is False and check(v, "consecutive_windows").passed is False


def test_blocks_held_before_the_soak_are_not_counted_as_leaked():
    ws = steady(kv_used_blocks=2)                              # someone else's request was running all along
    assert judge(ws, start_kv_blocks=2, th=Thresholds()).passed


def test_p99_ttft_regression_fails():
    ws = steady()
    ws[-1].p99_ttft_ms = 80.0 * 1.25
    v = judge(ws, 0, Thresholds())
    assert not v.passed
    ttft = check(v, "p99_ttft")
    assert ttft.value == pytest.approx(0.25) and ttft.passed is False
    assert check(v, "p99_tpot").passed


def test_p99_tpot_regression_fails_and_a_looser_threshold_lets_it_through():
    ws = steady()
    ws[-1].p99_tpot_ms = 20.0 * 1.2
    assert check(judge(ws, 0, Thresholds()), "p99_tpot").passed is False
    assert judge(ws, 0, Thresholds(max_p99_regression=0.25)).passed


def test_the_baseline_is_the_first_window_after_warm_up():
    ws = steady()
    ws[0].p99_ttft_ms = 500.0                                  # a cold first window would hide any later drift
    ws[-1].p99_ttft_ms = 120.0
    assert check(judge(ws, 0, Thresholds()), "p99_ttft").passed is False


def test_errors_and_5xx_fail():
    ws = steady()
    ws[3].failed, ws[3].errors = 2, {"500": 1, "timeout": 1}
    v = judge(ws, 0, Thresholds(max_error_rate=0.5))
    assert not v.passed and check(v, "5xx").value == 1 and check(v, "5xx").passed is False
    ws[3].errors = {"429": 2}
    v = judge(ws, 0, Thresholds())
    assert check(v, "5xx").passed and check(v, "error_rate").passed is False
    assert check(v, "error_rate").value == pytest.approx(2 / 600)


def test_a_bad_window_before_the_last_n_does_not_fail_the_consecutive_check():
    ws = steady()
    ws[1].kv_used_blocks = 5                                   # held for a while, then released
    v = judge(ws, 0, Thresholds(max_error_rate=0.0))
    assert v.holds[1] is False
    assert check(v, "consecutive_windows").passed and v.passed


def test_descriptor_and_thread_growth_fail_the_window():
    ws = steady()
    ws[-1].open_fds = 40 + 17
    v = judge(ws, 0, Thresholds())
    assert v.holds[-1] is False and not v.passed
    bad = [c.name for c in v.windows[-1] if c.passed is False]
    assert bad == ["fd_growth"]


def test_unmeasured_server_figures_are_not_judged():
    ws = steady(rss_bytes=None, threads=None, open_fds=None, kv_used_blocks=None)
    v = judge(ws, start_kv_blocks=None, th=Thresholds())
    assert v.passed
    assert check(v, "rss_slope").passed is None and check(v, "leaked_kv_blocks").passed is None


def test_too_few_windows_is_a_clear_error():
    with pytest.raises(ValueError, match="3 windows are too few"):
        judge(steady(3), 0, Thresholds())
    with pytest.raises(ValueError, match="max_error_rate"):
        Thresholds(max_error_rate=2).validate(10)

"""Arrival processes of `bench serve`: Poisson rate, gamma burstiness, and infinite rate."""
import math

import numpy as np
import pytest

from tokenfab.bench.arrivals import arrival_times, parse_rate

N = 20000


def gaps(rate, burstiness, seed=1):
    return np.diff(arrival_times(N, rate, burstiness, seed))


def test_poisson_mean_rate_is_the_requested_rate():
    g = gaps(8.0, 1.0)
    # mean of N exponential gaps: relative standard error 1/sqrt(N) ≈ 0.7%; allow 4 sigma
    assert 1.0 / g.mean() == pytest.approx(8.0, rel=4 / math.sqrt(N))


def test_poisson_gaps_have_coefficient_of_variation_one():
    g = gaps(8.0, 1.0)
    assert g.std() / g.mean() == pytest.approx(1.0, abs=0.03)


@pytest.mark.parametrize("burstiness", [0.25, 4.0])
def test_gamma_coefficient_of_variation_is_one_over_sqrt_burstiness_at_the_same_mean_rate(burstiness):
    g = gaps(5.0, burstiness)
    assert g.std() / g.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.05)
    assert 1.0 / g.mean() == pytest.approx(5.0, rel=0.03)


def test_schedule_starts_at_zero_and_never_goes_back():
    t = arrival_times(100, 3.0, 0.5, seed=2)
    assert t[0] == 0.0 and all(b >= a for a, b in zip(t, t[1:]))


def test_same_seed_same_schedule_other_seed_other_schedule():
    assert arrival_times(50, 2.0, 1.0, 7) == arrival_times(50, 2.0, 1.0, 7)
    assert arrival_times(50, 2.0, 1.0, 7) != arrival_times(50, 2.0, 1.0, 8)


def test_infinite_rate_sends_everything_at_once():
    assert arrival_times(5, math.inf) == [0.0] * 5


@pytest.mark.parametrize("rate,burst", [(0.0, 1.0), (-1.0, 1.0), (1.0, 0.0)])
def test_nonpositive_rate_or_burstiness_is_rejected(rate, burst):
    with pytest.raises(ValueError, match="must be positive"):
        arrival_times(3, rate, burst)


def test_rate_parsing_accepts_numbers_and_inf_only():
    assert parse_rate("inf") == math.inf and parse_rate("2.5") == 2.5
    for bad in ("fast", "0", "-3", "nan"):
        with pytest.raises(ValueError):
            parse_rate(bad)

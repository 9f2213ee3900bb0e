"""When each request is due: the arrival process of a serving benchmark.

Inter-arrival gaps are gamma-distributed with shape = burstiness and mean 1/rate, as in vLLM's
`bench serve`. Burstiness 1 is a Poisson process (exponential gaps); below 1 arrivals come in
bursts (the gaps' coefficient of variation is 1/sqrt(burstiness)); above 1 they are more even.
An infinite rate sends everything at once; the concurrency cap then does the pacing.
"""
from __future__ import annotations

import math

import numpy as np


def arrival_times(n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Offsets in seconds from the start; the first request is due at 0."""
    if rate <= 0:
        raise ValueError(f"request rate {rate} must be positive (or inf to send everything at once)")
    if burstiness <= 0:
        raise ValueError(f"burstiness {burstiness} must be positive (1 = Poisson, <1 burstier, >1 more even)")
    if n <= 0:
        return []
    if math.isinf(rate):
        return [0.0] * n
    gaps = np.random.default_rng(seed).gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n - 1)
    return [0.0] + np.cumsum(gaps).tolist()


def parse_rate(text: str) -> float:
    """``"4"``, ``"0.5"`` or ``"inf"`` → requests per second."""
    try:
        rate = float(text)
    except ValueError:
        raise ValueError(f"request rate {text!r} must be a number of requests/s or 'inf'") from None
    if rate <= 0 or math.isnan(rate):
        raise ValueError(f"request rate {text!r} must be positive (or inf)")
    return rate

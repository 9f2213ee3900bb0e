"""Length distributions for prompts and outputs.

A spec is either a number with a range ratio, as vLLM's random dataset takes it
(``512`` with ratio r draws integers uniformly from [512·(1−r), 512·(1+r)]), or a named
distribution: ``uniform:LO:HI``, ``normal:MEAN:STD``, ``lognormal:MEDIAN:SIGMA``.
Every draw is clipped to at least 1 token.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

_KINDS = ("fixed", "uniform", "normal", "lognormal")


@dataclass(frozen=True, slots=True)
class LengthDist:
    kind: str          # one of _KINDS
    a: float           # fixed: length; uniform: low; normal: mean; lognormal: median
    b: float = 0.0     # fixed: range ratio; uniform: high; normal: std; lognormal: sigma

    def sample(self, rng: np.random.Generator, n: int) -> list[int]:
        if self.kind == "fixed":
            lo, hi = math.floor(self.a * (1 - self.b)), math.ceil(self.a * (1 + self.b))
            x = rng.integers(lo, hi + 1, size=n) if hi > lo else np.full(n, round(self.a))
        elif self.kind == "uniform":
            x = rng.integers(int(self.a), int(self.b) + 1, size=n)
        elif self.kind == "normal":
            x = np.rint(rng.normal(self.a, self.b, size=n))
        else:
            x = np.rint(rng.lognormal(math.log(self.a), self.b, size=n))
        return [max(1, int(v)) for v in x]

    @property
    def mean(self) -> float:
        if self.kind == "fixed":
            return self.a
        if self.kind == "uniform":
            return (self.a + self.b) / 2
        if self.kind == "normal":
            return self.a
        return self.a * math.exp(self.b * self.b / 2)

    def describe(self) -> str:
        if self.kind == "fixed":
            return f"{self.a:g}" + (f" ±{self.b:.0%}" if self.b else "")
        return f"{self.kind}:{self.a:g}:{self.b:g}"


def parse_length(spec: str | int, range_ratio: float = 0.0) -> LengthDist:
    """``"512"`` (with `range_ratio`), or ``"uniform:LO:HI"``, ``"normal:MEAN:STD"``, ``"lognormal:MEDIAN:SIGMA"``."""
    text = str(spec).strip()
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"range ratio {range_ratio} must be in [0, 1): lengths are drawn from [L·(1−r), L·(1+r)]")
    if ":" not in text:
        try:
            value = float(text)
        except ValueError:
            raise ValueError(f"length {text!r} is not a number or a distribution "
                             "(e.g. 512, uniform:128:1024, normal:512:64, lognormal:512:0.6)") from None
        if value < 1:
            raise ValueError(f"length {text} must be at least 1 token")
        return LengthDist("fixed", value, range_ratio)
    kind, *params = text.split(":")
    if kind not in _KINDS[1:] or len(params) != 2:
        raise ValueError(f"length {text!r}: expected uniform:LO:HI, normal:MEAN:STD or lognormal:MEDIAN:SIGMA")
    try:
        a, b = float(params[0]), float(params[1])
    except ValueError:
        raise ValueError(f"length {text!r}: both parameters must be numbers") from None
    if kind == "uniform" and not 1 <= a <= b:
        raise ValueError(f"length {text!r}: need 1 <= LO <= HI")
    if kind in ("normal", "lognormal") and (a < 1 or b < 0):
        raise ValueError(f"length {text!r}: need a centre >= 1 and a spread >= 0")
    return LengthDist(kind, a, b)

"""Traffic for the simulator: length distributions, arrivals, online/offline mix, and SLO targets.

Arrivals are drawn as unit-rate gaps scaled by 1/rate, and lengths from a separate stream, so runs
at different rates with one seed see the same requests, only closer together (common random
numbers: comparisons across rates and replica counts are not blurred by sampling noise).
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass

_LENGTH_FORMS = "N | uniform:LO:HI | lognormal:MEDIAN:SIGMA | exp:MEAN | choice:A,B,..."


@dataclass(frozen=True, slots=True)
class LengthDist:
    kind: str
    params: tuple[float, ...]
    text: str

    def sample(self, rng: random.Random) -> int:
        k, p = self.kind, self.params
        if k == "fixed":
            v = p[0]
        elif k == "uniform":
            v = rng.randint(int(p[0]), int(p[1]))
        elif k == "lognormal":
            v = rng.lognormvariate(math.log(p[0]), p[1])
        elif k == "exp":
            v = rng.expovariate(1 / p[0])
        else:
            v = rng.choice(p)
        return max(1, round(v))

    @property
    def mean(self) -> float:
        k, p = self.kind, self.params
        return {"fixed": lambda: p[0], "uniform": lambda: (p[0] + p[1]) / 2,
                "lognormal": lambda: p[0] * math.exp(p[1] ** 2 / 2), "exp": lambda: p[0],
                "choice": lambda: sum(p) / len(p)}[k]()

    def __str__(self) -> str:
        return self.text


def parse_length(spec: str | int) -> LengthDist:
    text = str(spec).strip()
    kind, _, rest = text.partition(":")
    try:
        if not rest:
            v = int(kind)
            if v < 1:
                raise ValueError
            return LengthDist("fixed", (v,), text)
        if kind == "choice":
            vals = tuple(int(x) for x in rest.split(","))
            if not vals or min(vals) < 1:
                raise ValueError
            return LengthDist("choice", vals, text)
        vals = tuple(float(x) for x in rest.split(":"))
        ok = {"uniform": len(vals) == 2 and 1 <= vals[0] <= vals[1],
              "lognormal": len(vals) == 2 and vals[0] >= 1 and vals[1] >= 0,
              "exp": len(vals) == 1 and vals[0] >= 1}.get(kind)
        if not ok:
            raise ValueError
        return LengthDist(kind, vals, text)
    except ValueError:
        raise ValueError(f"bad length distribution {text!r}; use {_LENGTH_FORMS} (tokens, at least 1)") from None


@dataclass(slots=True)
class Request:
    id: int
    arrival: float
    prompt_len: int
    output_len: int
    offline: bool = False


def make_requests(rate: float, num: int, prompt: LengthDist, output: LengthDist, offline_share: float = 0.0,
                  seed: int = 0, burstiness: float = 1.0) -> list[Request]:
    """`num` requests arriving at `rate` per second: Poisson (burstiness 1) or gamma gaps with shape
    `burstiness` (below 1: burstier). A share of them are offline (batch) requests."""
    if rate <= 0:
        raise ValueError(f"request rate must be positive, got {rate}")
    if not 0 <= offline_share <= 1:
        raise ValueError(f"offline share must be in [0, 1], got {offline_share}")
    if burstiness <= 0:
        raise ValueError(f"burstiness must be positive, got {burstiness}")
    gaps, lengths, kinds = random.Random(seed), random.Random(seed + 1), random.Random(seed + 2)
    out, t = [], 0.0
    for i in range(num):
        t += gaps.gammavariate(burstiness, 1 / burstiness) / rate
        out.append(Request(i, t, prompt.sample(lengths), output.sample(lengths), kinds.random() < offline_share))
    return out


@dataclass(frozen=True, slots=True)
class SLO:
    """Latency targets on online requests, e.g. {('ttft', 99): 0.5, ('tpot', 99): 0.05} (seconds)."""
    targets: dict[tuple[str, float], float]

    @classmethod
    def parse(cls, spec: str) -> "SLO":
        """'ttft_p99:500,tpot_p99:50' (milliseconds) → SLO."""
        targets = {}
        for part in filter(None, (p.strip() for p in spec.split(","))):
            key, _, ms = part.partition(":")
            metric, _, pct = key.partition("_p")
            try:
                if metric not in ("ttft", "tpot", "e2e") or not 0 < float(pct) < 100 or float(ms) <= 0:
                    raise ValueError
                targets[(metric, float(pct))] = float(ms) / 1e3
            except ValueError:
                raise ValueError(f"bad SLO {part!r}; use METRIC_pPCT:MS with METRIC ttft, tpot or e2e, "
                                 "e.g. ttft_p99:500,tpot_p99:50") from None
        if not targets:
            raise ValueError("empty SLO; give e.g. ttft_p99:500,tpot_p99:50")
        return cls(targets)

    def __str__(self) -> str:
        return ",".join(f"{m}_p{p:g}:{v * 1e3:g}" for (m, p), v in self.targets.items())

"""Two Prometheus scrapes of a tokenfab server, as one measured window.

A `Scrape` is the text of `/metrics` parsed into samples; a `Window` is two scrapes some seconds
apart and answers what the rules ask: a gauge now, a counter's rate, a histogram's quantile over
the window only (bucket deltas, interpolated inside the bucket as Prometheus's
`histogram_quantile` does).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

PREFIX = "tokenfab:"


@dataclass(slots=True)
class Scrape:
    t: float                                            # seconds, any monotonic origin
    values: dict[str, float] = field(default_factory=dict)          # plain samples, labels dropped
    buckets: dict[str, list[tuple[float, float]]] = field(default_factory=dict)   # name -> [(le, cum. count)]
    info: dict[str, str] = field(default_factory=dict)              # labels of tokenfab:config_info

    @classmethod
    def parse(cls, text: str, t: float) -> "Scrape":
        s = cls(t=t)
        for fam in text_string_to_metric_families(text):
            for sample in fam.samples:
                name = sample.name.removeprefix(PREFIX)
                if name.endswith("_bucket"):
                    le = float(sample.labels["le"])
                    s.buckets.setdefault(name[:-len("_bucket")], []).append((le, sample.value))
                elif name == "config_info":
                    s.info = {k: v for k, v in sample.labels.items() if k != "model_name"}
                elif name.endswith("_created"):
                    continue
                else:
                    # Counters of several label sets (request_success by reason) add up.
                    s.values[name] = s.values.get(name, 0.0) + sample.value
        for b in s.buckets.values():
            b.sort()
        return s


@dataclass(slots=True)
class Window:
    before: Scrape
    after: Scrape

    @property
    def seconds(self) -> float:
        return max(self.after.t - self.before.t, 1e-9)

    def gauge(self, name: str) -> float:
        return self.after.values.get(name, 0.0)

    def gauge_before(self, name: str) -> float:
        return self.before.values.get(name, 0.0)

    def delta(self, name: str) -> float:
        return max(0.0, self.after.values.get(name, 0.0) - self.before.values.get(name, 0.0))

    def rate(self, name: str) -> float:
        return self.delta(name) / self.seconds

    def count(self, hist: str) -> float:
        return self.delta(hist + "_count")

    def mean(self, hist: str) -> float | None:
        n = self.count(hist)
        return self.delta(hist + "_sum") / n if n > 0 else None

    def quantile(self, hist: str, q: float) -> float | None:
        """The q-quantile of observations made inside the window; None if there were none."""
        after = self.after.buckets.get(hist, [])
        before = dict(self.before.buckets.get(hist, []))
        cum = [(le, c - before.get(le, 0.0)) for le, c in after]
        if not cum or cum[-1][1] <= 0:
            return None
        rank = q * cum[-1][1]
        lo_edge, lo_count = 0.0, 0.0
        for le, c in cum:
            if c >= rank:
                if math.isinf(le):          # in the overflow bucket: the last finite edge is all we know
                    return lo_edge
                return lo_edge + (le - lo_edge) * ((rank - lo_count) / (c - lo_count) if c > lo_count else 1.0)
            lo_edge, lo_count = le, c
        return lo_edge

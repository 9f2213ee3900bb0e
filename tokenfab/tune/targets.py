"""The targets `tokenfab tune` must meet, and how far a measurement is from each.

Latency targets are P99 TTFT and P99 TPOT in milliseconds, over a bench run's completed requests;
the quality floor is a mean KL divergence ceiling, or a same-top-1 agreement floor in percent,
against the full-precision model (`tokenfab quant eval`). A run with failed requests fails every
latency target: a configuration that drops requests is not one to deploy.
"""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Check:
    name: str              # "P99 TTFT", "P99 TPOT", "mean KL", "same top-1", "failed requests"
    value: float
    limit: float
    upper: bool            # True: value must be <= limit; False: value must be >= limit
    unit: str = ""

    @property
    def ok(self) -> bool:
        return self.value <= self.limit if self.upper else self.value >= self.limit

    @property
    def excess(self) -> float:
        """How far past the limit, as a share of it (0 when it holds): 0.25 = 25 % over (or under)."""
        if self.ok:
            return 0.0
        if self.upper:
            return math.inf if self.limit <= 0 else self.value / self.limit - 1
        return (self.limit - self.value) / self.limit if self.limit else math.inf

    def describe(self) -> str:
        rel = "at most" if self.upper else "at least"
        text = f"{self.name} {self.value:.4g}{self.unit} (target: {rel} {self.limit:.4g}{self.unit})"
        if self.ok:
            return text
        diff = abs(self.value - self.limit)
        ratio = f", {self.value / self.limit:.3g}x the target" if self.upper and self.limit > 0 else ""
        return f"{text}: {diff:.4g}{self.unit} {'over' if self.upper else 'short'}{ratio}"


@dataclass(frozen=True, slots=True)
class Targets:
    p99_ttft_ms: float | None = None
    p99_tpot_ms: float | None = None
    max_kl: float | None = None
    min_top1: float | None = None      # percent

    def validate(self) -> None:
        for name in ("p99_ttft_ms", "p99_tpot_ms"):
            v = getattr(self, name)
            if v is not None and not v > 0:
                raise ValueError(f"--{name.replace('_', '-')} must be a positive number of milliseconds, got {v}")
        if self.p99_ttft_ms is None and self.p99_tpot_ms is None:
            raise ValueError("give at least one latency target: --p99-ttft-ms MS and/or --p99-tpot-ms MS")
        if self.max_kl is not None and not self.max_kl >= 0:
            raise ValueError(f"--max-kl must be 0 or more, got {self.max_kl}")
        if self.min_top1 is not None and not 0 <= self.min_top1 <= 100:
            raise ValueError(f"--min-top1 is a percentage in [0, 100], got {self.min_top1}")

    def slos(self) -> dict[str, float]:
        """bench's goodput SLOs: a request is good when it meets both latency targets."""
        return {k: v for k, v in (("ttft", self.p99_ttft_ms), ("tpot", self.p99_tpot_ms)) if v is not None}

    def speed_checks(self, metrics: dict) -> list[Check]:
        out = []
        if metrics.get("failed"):
            out.append(Check("failed requests", metrics["failed"], 0, True))
        for name, key, target in (("P99 TTFT", "p99_ttft_ms", self.p99_ttft_ms),
                                  ("P99 TPOT", "p99_tpot_ms", self.p99_tpot_ms)):
            if target is not None:
                value = metrics.get(key)
                out.append(Check(name, math.inf if value is None else value, target, True, " ms"))
        return out

    def quality_checks(self, quality: dict) -> list[Check]:
        out = []
        if self.max_kl is not None:
            out.append(Check("mean KL", quality["kl_mean"], self.max_kl, True))
        if self.min_top1 is not None:
            out.append(Check("same top-1", quality["same_top1_pct"], self.min_top1, False, " %"))
        return out

    def as_dict(self) -> dict:
        return {"p99_ttft_ms": self.p99_ttft_ms, "p99_tpot_ms": self.p99_tpot_ms, "max_kl": self.max_kl,
                "min_top1": self.min_top1}

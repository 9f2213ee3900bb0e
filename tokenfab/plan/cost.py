"""Cost per hour of a device, and cost per million tokens at a throughput and utilization.

Owned hardware, per wall-clock hour (power is drawn at TDP whenever the machine is on, which
overstates idle hours and so errs on the expensive side):

    capex/h = price / (years × 8760)
    power/h = TDP kW × PUE × $/kWh
    total/h = capex/h + power/h + extra $/h

Rented hardware: total/h = the rental $/h (power and hardware included) + extra $/h.

    $ per million tokens = total/h ÷ (tokens/s × 3600 × utilization) × 1e6
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from tokenfab.plan.hardware import Hardware

HOURS_PER_YEAR = 8760


@dataclass(frozen=True, slots=True)
class CostAssumptions:
    years: float = 3.0                 # amortization period of owned hardware
    utilization: float = 0.5           # share of wall time spent serving at full throughput
    usd_per_kwh: float = 0.12
    pue: float = 1.4                   # data-centre power usage effectiveness
    extra_usd_per_hour: float = 0.0    # per device: hosting, network, staff ...
    pricing: str = "auto"              # own | rent | auto (own when price and TDP are known)

    def __post_init__(self):
        if self.years <= 0:
            raise ValueError(f"amortization years must be positive, got {self.years}")
        if not 0 < self.utilization <= 1:
            raise ValueError(f"utilization must be in (0, 1], got {self.utilization}")
        if self.pue < 1:
            raise ValueError(f"PUE is at least 1 (1.0 = no cooling overhead), got {self.pue}")
        if self.pricing not in ("own", "rent", "auto"):
            raise ValueError(f"pricing must be own, rent or auto, got {self.pricing!r}")

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class HourlyCost:
    pricing: str
    capex: float
    power: float
    rent: float
    extra: float

    @property
    def total(self) -> float:
        return self.capex + self.power + self.rent + self.extra

    def as_dict(self) -> dict:
        return {"pricing": self.pricing, "capex": self.capex, "power": self.power, "rent": self.rent,
                "extra": self.extra, "total": self.total}


def hourly_cost(hw: Hardware, a: CostAssumptions, devices: int = 1) -> HourlyCost:
    pricing = a.pricing
    if pricing == "auto":
        pricing = "own" if hw.price_usd and hw.tdp_w else "rent"
    extra = a.extra_usd_per_hour * devices
    if pricing == "own":
        if not hw.price_usd or not hw.tdp_w:
            raise ValueError(f"{hw.name} has no price_usd/tdp_w in the catalog; give them in a --hardware-file "
                             "or use --pricing rent")
        capex = hw.price_usd / (a.years * HOURS_PER_YEAR) * devices
        power = hw.tdp_w / 1000 * a.pue * a.usd_per_kwh * devices
        return HourlyCost("own", capex=capex, power=power, rent=0.0, extra=extra)
    if not hw.usd_per_hour:
        if a.extra_usd_per_hour:
            return HourlyCost("rent", capex=0.0, power=0.0, rent=0.0, extra=extra)
        raise ValueError(f"{hw.name} has no usd_per_hour (and no price_usd) in the catalog; add them in a "
                         "--hardware-file, or give --extra-usd-per-hour")
    return HourlyCost("rent", capex=0.0, power=0.0, rent=hw.usd_per_hour * devices, extra=extra)


def usd_per_million_tokens(usd_per_hour: float, tokens_per_s: float, utilization: float = 1.0) -> float:
    """Cost of a million tokens when `tokens_per_s` is sustained for `utilization` of each hour."""
    if tokens_per_s <= 0:
        return float("inf")
    return usd_per_hour / (tokens_per_s * 3600 * utilization) * 1e6

"""The hardware catalog: memory, bandwidth, peak FLOPS per dtype, power, price, interconnect.

The shipped catalog is `hardware.yaml` beside this file. Entries in the user's file
(`~/.config/tokenfab/hardware.yaml`, or $TOKENFAB_HARDWARE_FILE) and in files given with
`--hardware-file` are layered on top, later ones winning by name. `tokenfab plan probe` and
`tokenfab plan calibrate` write their measured entries into the user's file.
"""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

import yaml

BUILTIN_FILE = Path(__file__).with_name("hardware.yaml")
_REQUIRED = ("memory_gib", "bandwidth_gb_s", "tflops")


def user_hardware_file() -> Path:
    env = os.environ.get("TOKENFAB_HARDWARE_FILE")
    return Path(env) if env else Path.home() / ".config" / "tokenfab" / "hardware.yaml"


@dataclass(slots=True)
class Hardware:
    name: str
    memory_gib: float
    bandwidth_gb_s: float
    tflops: dict[str, float]
    kind: str = "gpu"
    tdp_w: float | None = None
    price_usd: float | None = None
    usd_per_hour: float | None = None
    interconnect: str | None = None
    interconnect_gb_s: float | None = None
    interconnect_latency_us: float | None = None   # None: the backend's default (comm.BACKEND_DEFAULTS), else 10
    interconnect_backend: str | None = None         # shm | gloo | nccl: supplies link defaults the entry leaves out
    # Tensor-parallel ranks are processes on this one device (CPU ranks on one host): they split its
    # bandwidth, compute and memory instead of each bringing their own, so TP buys no speed here.
    tp_shares_device: bool = False
    source: str = ""
    efficiency: dict[str, float] | None = None     # calibrated {bandwidth, compute}
    step_overhead_ms: float | None = None          # calibrated per-step overhead
    extra: dict = field(default_factory=dict)      # anything else the entry carries (kept, not used)
    origin: str = ""                               # the file it was read from

    def __post_init__(self):
        if self.interconnect_backend is not None:
            from tokenfab.plan.comm import BACKEND_DEFAULTS
            if self.interconnect_backend not in BACKEND_DEFAULTS:
                raise ValueError(f"{self.name}: interconnect_backend must be one of {', '.join(BACKEND_DEFAULTS)}, "
                                 f"got {self.interconnect_backend!r}")
            for k, v in BACKEND_DEFAULTS[self.interconnect_backend].items():
                if getattr(self, k) is None:
                    setattr(self, k, v)
        if self.interconnect_latency_us is None:
            self.interconnect_latency_us = 10.0

    @property
    def memory_bytes(self) -> float:
        return self.memory_gib * 2**30

    @property
    def bandwidth(self) -> float:
        """Bytes per second."""
        return self.bandwidth_gb_s * 1e9

    def peak_flops(self, dtype: str) -> float:
        """FLOPs per second for matmuls with activations in `dtype`. fp16 and bf16 stand in for each
        other (tensor cores run both at one rate); other formats must be listed."""
        names = [dtype] + {"fp16": ["bf16"], "bf16": ["fp16"]}.get(dtype, [])
        for n in names:
            if self.tflops.get(n):
                return float(self.tflops[n]) * 1e12
        known = ", ".join(k for k, v in self.tflops.items() if v)
        raise ValueError(f"{self.name} has no published {dtype} peak; it lists {known}. "
                         f"Choose --act-dtype from those, or add tflops.{dtype} in a --hardware-file")

    def to_entry(self) -> dict:
        """The YAML mapping for this entry (without name and origin)."""
        d = asdict(self)
        for k in ("name", "origin", "extra"):
            d.pop(k)
        d.update(self.extra)
        return {k: v for k, v in d.items() if v is not None and not (k == "tp_shares_device" and v is False)}


def _from_entry(name: str, entry: dict, origin: str) -> Hardware:
    if not isinstance(entry, dict):
        raise ValueError(f"{origin}: entry {name!r} must be a mapping of fields, got {type(entry).__name__}")
    missing = [k for k in _REQUIRED if entry.get(k) in (None, {}, "")]
    if missing:
        raise ValueError(f"{origin}: entry {name!r} needs {', '.join(missing)} "
                         f"(e.g. memory_gib: 24, bandwidth_gb_s: 936, tflops: {{fp16: 71}})")
    known = set(Hardware.__dataclass_fields__) - {"name", "extra", "origin"}
    fields_ = {k: v for k, v in entry.items() if k in known}
    extra = {k: v for k, v in entry.items() if k not in known}
    tflops = {str(k).lower(): float(v) for k, v in (fields_.pop("tflops") or {}).items() if v is not None}
    return Hardware(name=name, tflops=tflops, extra=extra, origin=origin, **fields_)


def read_hardware_file(path: str | Path) -> dict[str, Hardware]:
    path = Path(path).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"hardware file {path} does not exist")
    with open(path) as f:
        data = yaml.safe_load(f) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping of hardware name → fields")
    return {_key(n): _from_entry(str(n), e, str(path)) for n, e in data.items()}


def _key(name: str) -> str:
    return str(name).strip().lower().replace("_", "-").replace(" ", "-")


def load_catalog(extra_files: list[str] | tuple[str, ...] = (), include_user: bool = True) -> dict[str, Hardware]:
    """Built-in entries, then the user's file (if present), then `extra_files` in order."""
    catalog = read_hardware_file(BUILTIN_FILE)
    user = user_hardware_file()
    if include_user and user.exists():
        catalog.update(read_hardware_file(user))
    for f in extra_files:
        catalog.update(read_hardware_file(f))
    return catalog


def get_hardware(name: str, catalog: dict[str, Hardware]) -> Hardware:
    hw = catalog.get(_key(name))
    if hw is None:
        raise ValueError(f"unknown hardware {name!r}; known: {', '.join(sorted(catalog))} "
                         "(add more with --hardware-file, or measure this machine with `tokenfab plan probe`)")
    return hw


def save_entry(path: str | Path, name: str, entry: dict) -> Path:
    """Add or replace one entry in a YAML hardware file, keeping the others."""
    path = Path(path).expanduser()
    data = {}
    if path.exists():
        with open(path) as f:
            data = yaml.safe_load(f) or {}
    data[name] = entry
    _from_entry(name, entry, str(path))   # refuse to write an entry we could not read back
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        yaml.safe_dump(data, f, sort_keys=False)
    return path

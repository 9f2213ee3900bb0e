"""The roofline cost model: FLOPs and bytes of an engine step, and the time they imply.

    step_time = max(bytes / (bandwidth × eff_bw), flops / (peak × eff_compute)) + comm + overhead

A step is described by a `StepShape` (tokens, sequences, attention pairs, KV read), the same
summary the simulator builds from a scheduled batch, so prefill, decode and mixed steps are costed
by one formula. Results are ceilings: the efficiencies say how close to the spec sheet an engine
gets (defaults 0.8 and 0.5; `tokenfab plan calibrate` measures them).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from tokenfab.costmodel.shape import StepShape
from tokenfab.plan import comm
from tokenfab.plan.dtypes import DType, parse_dtype
from tokenfab.plan.hardware import Hardware
from tokenfab.plan.models import ModelSpec

DEFAULT_BW_EFF = 0.8
DEFAULT_COMPUTE_EFF = 0.5


@dataclass(frozen=True, slots=True)
class Efficiency:
    bandwidth: float = DEFAULT_BW_EFF
    compute: float = DEFAULT_COMPUTE_EFF
    step_overhead_s: float = 0.0
    source: str = "default"

    @classmethod
    def resolve(cls, hw: Hardware, bandwidth: float | None = None, compute: float | None = None,
                overhead_ms: float | None = None) -> "Efficiency":
        """Flags win over the hardware entry's calibrated values, which win over the defaults."""
        cal = hw.efficiency or {}
        src = "calibrated" if (cal or hw.step_overhead_ms is not None) else "default"
        if bandwidth is not None or compute is not None or overhead_ms is not None:
            src = "flags" if src == "default" else "flags+calibrated"
        eff = cls(bandwidth=bandwidth if bandwidth is not None else cal.get("bandwidth", DEFAULT_BW_EFF),
                  compute=compute if compute is not None else cal.get("compute", DEFAULT_COMPUTE_EFF),
                  step_overhead_s=(overhead_ms if overhead_ms is not None else hw.step_overhead_ms or 0.0) / 1e3,
                  source=src)
        for name in ("bandwidth", "compute"):
            if not 0 < getattr(eff, name) <= 1.5:
                raise ValueError(f"{name} efficiency must be in (0, 1.5], got {getattr(eff, name)}")
        return eff


@dataclass(frozen=True, slots=True)
class Deployment:
    """A model in given dtypes on `tp` devices of one hardware type: everything a step costs from."""
    model: ModelSpec
    hardware: Hardware
    weight_dtype: DType
    kv_dtype: DType
    act_dtype: DType
    tp: int = 1
    eff: Efficiency = field(default_factory=Efficiency)

    @classmethod
    def make(cls, model: ModelSpec, hardware: Hardware, weight_dtype: str | None = None,
             kv_dtype: str | None = None, act_dtype: str | None = None, tp: int = 1,
             eff: Efficiency | None = None) -> "Deployment":
        # Activations: the faster of the model's half-precision format and fp32 on this hardware
        # (half on GPUs; fp32 on CPUs without native bf16/fp16 matmuls, ~50x slower there).
        half = model.default_dtype if model.default_dtype in ("bf16", "fp16") else "fp16"
        peaks = {d: hardware.tflops.get(d) or hardware.tflops.get({"bf16": "fp16", "fp16": "bf16"}.get(d, d)) or 0.0
                 for d in (half, "fp32")}
        act = act_dtype or max(peaks, key=lambda d: (peaks[d], d != "fp32"))
        act_t = parse_dtype(act)
        if act_t.group_size or act_t.name not in ("fp32", "bf16", "fp16", "fp8", "int8", "int4", "tf32"):
            raise ValueError(f"activation dtype must be a plain format (fp32, bf16, fp16, fp8, int8), got {act!r}")
        if tp < 1 or model.heads % tp:
            raise ValueError(f"tensor-parallel degree must divide the {model.heads} attention heads, got {tp}")
        return cls(model=model, hardware=hardware, weight_dtype=parse_dtype(weight_dtype or model.default_dtype),
                   kv_dtype=parse_dtype(kv_dtype or act), act_dtype=act_t, tp=tp,
                   eff=eff or Efficiency.resolve(hardware))

    @property
    def weight_bytes_per_device(self) -> float:
        return self.model.weight_bytes(self.weight_dtype) / self.tp

    @property
    def kv_share(self) -> float:
        """Fraction of a token's KV one device holds; KV heads are replicated when tp > kv_heads."""
        kvh = self.model.kv_heads
        return math.ceil(kvh / self.tp) / kvh

    @property
    def kv_bytes_per_token_per_device(self) -> float:
        return self.model.kv_bytes_per_token(self.kv_dtype) * self.kv_share

    @property
    def device_share(self) -> int:
        """How many ranks split one device's bandwidth, compute and memory: t when the ranks are
        processes on one CPU host (`tp_shares_device`), else 1 (a device per rank)."""
        return self.tp if self.hardware.tp_shares_device else 1

    @property
    def peak_flops(self) -> float:
        return self.hardware.peak_flops(self.act_dtype.name)

    @property
    def ridge_intensity(self) -> float:
        """FLOPs per byte above which a step is compute-bound, efficiencies applied."""
        return (self.peak_flops * self.eff.compute) / (self.hardware.bandwidth * self.eff.bandwidth)


@dataclass(frozen=True, slots=True)
class StepTime:
    flops: float
    bytes: float
    compute_s: float
    memory_s: float
    comm_s: float
    overhead_s: float

    @property
    def total_s(self) -> float:
        return max(self.compute_s, self.memory_s) + self.comm_s + self.overhead_s

    @property
    def bound(self) -> str:
        return "compute" if self.compute_s >= self.memory_s else "memory"

    @property
    def intensity(self) -> float:
        return self.flops / self.bytes if self.bytes else math.inf


def new_shape(dep: Deployment) -> StepShape:
    m = dep.model
    return StepShape(window=m.sliding_window, global_frac=m.global_layer_fraction)


def allreduce_s(dep: Deployment, nbytes: float) -> float:
    """One all-reduce of `nbytes` across the deployment's ranks (comm.allreduce_s: the catalog's
    in-step latency plus the ring's 2(t−1)/t of the message over the link)."""
    t = dep.tp
    if t == 1:
        return 0.0
    hw = dep.hardware
    if not hw.interconnect_gb_s:
        raise ValueError(f"{hw.name} has no interconnect_gb_s, so tensor parallelism cannot be costed; "
                         "add it (or interconnect_backend: shm | gloo | nccl) in a --hardware-file")
    return comm.allreduce_s(t, nbytes, hw.interconnect_latency_us, hw.interconnect_gb_s)


def step_time(dep: Deployment, shape: StepShape) -> StepTime:
    m, e = dep.model, dep.eff
    # The LM head runs only where a token is sampled (once per sequence), not on every prompt token.
    head = m.vocab * m.hidden
    flops = (2.0 * ((m.matmul_params_per_token - head) * shape.num_tokens + head * shape.num_seqs)
             + m.attn_flops_per_pair * shape.attn_pairs) / dep.tp
    # Weights stream once per step; KV is read for every context token and written for new ones.
    nbytes = (m.weight_bytes_read(dep.weight_dtype, shape.num_tokens) / dep.tp
              + dep.kv_bytes_per_token_per_device * (shape.kv_tokens + shape.num_tokens))
    # Two all-reduces per layer (after attention and after the MLP) of the step's hidden states.
    comm_s = 2 * m.layers * allreduce_s(dep, dep.act_dtype.nbytes(shape.num_tokens * m.hidden)) if dep.tp > 1 else 0.0
    share = dep.device_share
    return StepTime(flops=flops, bytes=nbytes, compute_s=share * flops / (dep.peak_flops * e.compute),
                    memory_s=share * nbytes / (dep.hardware.bandwidth * e.bandwidth), comm_s=comm_s,
                    overhead_s=e.step_overhead_s)


class RooflineCost:
    """The simulator's step-cost interface (`new_shape`, `step_time`) over the roofline.

    Same numbers as `step_time(dep, shape).total_s`, with the per-deployment constants folded once:
    the simulator calls this for every step, and a simulated hour is ~10^5 steps."""

    def __init__(self, dep: Deployment):
        self.dep = dep
        m, e, t = dep.model, dep.eff, dep.tp
        self._inv_compute = dep.device_share / (dep.peak_flops * e.compute)
        self._inv_bw = dep.device_share / (dep.hardware.bandwidth * e.bandwidth)
        self._flops_tok = 2.0 * (m.matmul_params_per_token - m.vocab * m.hidden) / t
        self._flops_seq = 2.0 * m.vocab * m.hidden / t
        self._flops_pair = m.attn_flops_per_pair / t
        self._kv = dep.kv_bytes_per_token_per_device
        self._dense_bytes = m.weight_bytes_read(dep.weight_dtype, 1) / t if not m.is_moe else 0.0
        self._overhead = e.step_overhead_s
        self._comm_tok = self._comm_fixed = 0.0
        if t > 1:
            self._comm_fixed = 2 * m.layers * allreduce_s(dep, 0.0)
            self._comm_tok = 2 * m.layers * allreduce_s(dep, dep.act_dtype.nbytes(m.hidden)) - self._comm_fixed

    def new_shape(self) -> StepShape:
        return new_shape(self.dep)

    def step_time(self, shape: StepShape) -> float:
        n = shape.num_tokens
        w = self._dense_bytes or self.dep.model.weight_bytes_read(self.dep.weight_dtype, n) / self.dep.tp
        mem = (w + self._kv * (shape.kv_tokens + n)) * self._inv_bw
        flops = self._flops_tok * n + self._flops_seq * shape.num_seqs + self._flops_pair * shape.attn_pairs
        comp = flops * self._inv_compute
        comm = self._comm_fixed + self._comm_tok * n if self._comm_fixed else 0.0
        return (mem if mem > comp else comp) + comm + self._overhead


def prefill(dep: Deployment, prompt_len: int, chunk: int | None = None) -> tuple[StepTime, float]:
    """(the whole prompt as one step, TTFT when run alone in chunks of `chunk` tokens)."""
    whole = new_shape(dep)
    whole.add(0, prompt_len)
    one = step_time(dep, whole)
    if not chunk or chunk >= prompt_len:
        return one, one.total_s
    ttft, done = 0.0, 0
    while done < prompt_len:
        n = min(chunk, prompt_len - done)
        s = new_shape(dep)
        s.add(done, n)
        ttft += step_time(dep, s).total_s
        done += n
    return one, ttft


def decode(dep: Deployment, batch: int, context: int) -> StepTime:
    """One decode step of `batch` sequences, each with `context` tokens already cached."""
    s = new_shape(dep)
    s.add(context, 1, count=batch)
    return step_time(dep, s)


def crossover_batch(dep: Deployment, context: int, max_batch: int = 1 << 16) -> int | None:
    """Smallest decode batch that is compute-bound at `context`; None if none up to `max_batch`
    (long contexts can stay memory-bound at any batch, since KV reads grow with the batch too)."""
    bound = lambda b: decode(dep, b, context).bound == "compute"  # noqa: E731
    hi = 1
    while not bound(hi):
        if hi >= max_batch:
            return None
        hi *= 2
    lo = hi // 2       # not compute-bound (or 0)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if bound(mid) else (mid, hi)
    return hi

"""What fits in device memory: weights, KV cache, activations and runtime overhead.

    usable   = memory × memory_utilization            (vLLM's gpu_memory_utilization, default 0.9)
    kv pool  = usable − weights − activations − runtime overhead
    max seqs = kv pool / KV of one request at the context length (rounded up to whole blocks)

With tensor parallelism each device holds 1/t of the weights and of the KV heads (KV heads are
replicated once t exceeds them), and every layer pays two all-reduces over the interconnect.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

from tokenfab.plan import roofline
from tokenfab.plan.roofline import Deployment

GB = 1e9


@dataclass(frozen=True, slots=True)
class MemorySettings:
    context: int                        # tokens per request (prompt + output)
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048  # the engine's default token budget per step
    memory_utilization: float = 0.9
    runtime_overhead_gib: float = 1.0   # CUDA context, graphs, allocator slack (a CPU process: less)
    block_size: int = 16

    def __post_init__(self):
        if self.context < 1:
            raise ValueError(f"context must be at least 1 token, got {self.context}")
        if not 0 < self.memory_utilization <= 1:
            raise ValueError(f"memory utilization must be in (0, 1], got {self.memory_utilization}")


@dataclass(frozen=True, slots=True)
class MemoryPlan:
    tp: int
    capacity: float            # bytes per device
    usable: float
    weights: float             # per device, all in bytes
    activations: float
    overhead: float
    kv_per_token: float
    kv_per_request: float
    kv_budget: float
    max_seqs: int              # concurrent requests at the context length that memory allows
    fits: bool
    reason: str

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def activation_bytes(dep: Deployment, s: MemorySettings) -> float:
    """Peak transient memory of one step of `max_num_batched_tokens` tokens: hidden states, q/k/v,
    the MLP's gate and up projections, and fp32 logits for up to `max_num_seqs` sampled rows
    (twice: logits and their softmax). Attention scores are not stored (fused/flash attention)."""
    m, t = dep.model, dep.tp
    tokens = s.max_num_batched_tokens
    qkv = (m.heads + 2 * m.kv_heads) * m.head_dim
    mlp = 2 * m.intermediate * (m.experts_per_token if m.is_moe else 1)
    per_token = 3 * m.hidden + (qkv + mlp) / t
    logits = 2 * 4.0 * min(s.max_num_seqs, tokens) * m.vocab / t
    return dep.act_dtype.nbytes(tokens * per_token) + logits


def plan_memory(dep: Deployment, s: MemorySettings) -> MemoryPlan:
    m = dep.model
    capacity = dep.hardware.memory_bytes / dep.device_share      # ranks on one host split its memory
    usable = capacity * s.memory_utilization
    weights = dep.weight_bytes_per_device
    acts = activation_bytes(dep, s)
    overhead = s.runtime_overhead_gib * 2**30
    rounded = math.ceil(s.context / s.block_size) * s.block_size
    per_req = m.kv_bytes_for_context(rounded, dep.kv_dtype) * dep.kv_share
    budget = usable - weights - acts - overhead
    max_seqs = max(0, int(budget // per_req)) if per_req else 0
    if weights + acts + overhead > usable:
        reason = (f"weights {weights / GB:.1f} GB + activations {acts / GB:.1f} GB + overhead "
                  f"{overhead / GB:.1f} GB exceed the usable {usable / GB:.1f} GB")
    elif max_seqs < 1:
        reason = (f"the model loads but one {s.context}-token request needs {per_req / GB:.2f} GB of KV "
                  f"and only {budget / GB:.2f} GB is left")
    else:
        reason = f"{max_seqs} concurrent {s.context}-token requests fit"
    return MemoryPlan(tp=dep.tp, capacity=capacity, usable=usable, weights=weights, activations=acts,
                      overhead=overhead, kv_per_token=dep.kv_bytes_per_token_per_device,
                      kv_per_request=per_req, kv_budget=max(budget, 0.0), max_seqs=max_seqs,
                      fits=max_seqs >= 1, reason=reason)


def kv_blocks(plan: MemoryPlan, block_size: int) -> int:
    """Size of the KV pool in blocks (what the engine would allocate)."""
    return int(plan.kv_budget // (plan.kv_per_token * block_size)) if plan.kv_per_token else 0


@dataclass(frozen=True, slots=True)
class TPOption:
    plan: MemoryPlan
    batch: int                 # decode batch used for the throughput column
    step_s: float              # decode step at that batch, communication included
    comm_s: float
    tok_s: float               # decode tokens/s of the whole group
    single_tok_s: float        # one sequence alone

    def as_dict(self) -> dict:
        return {"tp": self.plan.tp, "memory": self.plan.as_dict(), "batch": self.batch, "step_s": self.step_s,
                "comm_s": self.comm_s, "tok_s": self.tok_s, "single_stream_tok_s": self.single_tok_s}


def tp_options(dep: Deployment, s: MemorySettings, degrees: tuple[int, ...] = (1, 2, 4, 8)) -> list[TPOption]:
    """Each tensor-parallel degree that divides the heads: what fits, and decode speed at the largest
    batch that fits (capped at max_num_seqs), communication over the interconnect included."""
    out = []
    for t in degrees:
        if dep.model.heads % t:
            continue
        if t > 1 and not dep.hardware.interconnect_gb_s:
            continue
        d = replace(dep, tp=t)
        plan = plan_memory(d, s)
        batch = max(1, min(plan.max_seqs, s.max_num_seqs))
        st = roofline.decode(d, batch, s.context)
        one = roofline.decode(d, 1, s.context).total_s
        out.append(TPOption(plan=plan, batch=batch, step_s=st.total_s, comm_s=st.comm_s,
                            tok_s=batch / st.total_s, single_tok_s=1 / one))
    return out


def smallest_fitting_tp(dep: Deployment, s: MemorySettings, max_tp: int = 8) -> int | None:
    for opt in tp_options(dep, s, tuple(t for t in (1, 2, 4, 8, 16) if t <= max_tp)):
        if opt.plan.fits:
            return opt.plan.tp
    return None

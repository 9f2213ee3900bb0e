"""Which part of the model a tensor-parallel rank owns (Megatron-style), and the all-reduce it needs.

Per decoder layer, rank r of t owns:
- attention heads r*H/t .. (r+1)*H/t - 1 and KV heads r*KVH/t .. (r+1)*KVH/t - 1: the matching rows of
  q_proj / k_proj / v_proj (and their biases): column-parallel, no communication. Heads are contiguous,
  so a query head's GQA partner (head // (H/KVH)) lands on the same rank. With fewer KV heads than
  ranks (t a multiple of KVH, as vLLM allows), each KV head is replicated on the t/KVH ranks whose
  query heads use it: rank r holds KV head r // (t/KVH);
- the matching columns of o_proj: row-parallel, its partial sums all-reduced across ranks;
- rows r*I/t .. (r+1)*I/t - 1 of gate_proj and up_proj (column-parallel) and those columns of down_proj
  (row-parallel + all-reduce).
Embeddings, norms, q/k norms and the LM head are replicated: the LM head runs on rank 0 only (workers ask
for no logits), so replicating it costs memory, not time. A rank's KV pool holds only its KV heads.

Sharding happens on the HF-named float weights before the model is built, so a rank's model is an
ordinary LlamaModel of a smaller config (`shard_config`) and loads as one; `wrap_row_parallel` then puts
the all-reduce behind o_proj and down_proj.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field, replace

import torch
from torch import nn


def check_divisible(cfg, tp: int) -> None:
    """ValueError naming the numbers when the model does not split into `tp` equal shards."""
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise ValueError(f"tensor_parallel_size must be a positive integer, got {tp!r}")
    if tp > 1 and cfg.num_experts:
        raise ValueError(f"tensor_parallel_size {tp}: mixture-of-experts models ({cfg.num_experts} experts) are not "
                         "sharded yet; use tensor_parallel_size 1")
    kv_ok = cfg.num_kv_heads % tp == 0 or tp % cfg.num_kv_heads == 0    # split, or replicated
    for what, n in (("attention heads", cfg.num_heads), ("KV heads", 0 if kv_ok else cfg.num_kv_heads),
                    ("MLP intermediate size", cfg.intermediate_size)):
        if n % tp:
            raise ValueError(f"tensor_parallel_size {tp} does not divide the model's {n} {what}; "
                             f"use a size that divides {cfg.num_heads} heads and intermediate size "
                             f"{cfg.intermediate_size} and divides or is a multiple of {cfg.num_kv_heads} KV heads")


def shard_config(cfg, tp: int):
    """The per-rank ModelConfig: 1/tp of the heads, KV heads (at least one) and MLP width; head_dim and
    hidden size unchanged."""
    check_divisible(cfg, tp)
    return replace(cfg, num_heads=cfg.num_heads // tp, num_kv_heads=max(1, cfg.num_kv_heads // tp),
                   intermediate_size=cfg.intermediate_size // tp)


def _rows(w: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
    n = w.shape[0] // tp
    return w[rank * n:(rank + 1) * n]


def _cols(w: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
    n = w.shape[1] // tp
    return w[:, rank * n:(rank + 1) * n]


def shard_weights(weights: dict[str, torch.Tensor], cfg, rank: int, tp: int) -> dict[str, torch.Tensor]:
    """HF-named weights -> this rank's share (views; everything not split is passed through)."""
    check_divisible(cfg, tp)
    out = dict(weights)
    kvh = cfg.num_kv_heads
    # K/V: split like q when there are enough KV heads, else rank r takes (a copy of) KV head r // (tp / kvh)
    kv_rank, kv_parts = (rank, tp) if kvh % tp == 0 else (rank // (tp // kvh), kvh)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        for name in ("q", "k", "v"):
            r, n = (rank, tp) if name == "q" else (kv_rank, kv_parts)
            for kind in ("weight", "bias"):
                key = f"{p}self_attn.{name}_proj.{kind}"
                if key in out:      # rows are heads x head_dim, so a row slice is a head slice
                    out[key] = _rows(out[key], r, n)
        out[p + "self_attn.o_proj.weight"] = _cols(out[p + "self_attn.o_proj.weight"], rank, tp)
        for name in ("gate", "up"):
            out[f"{p}mlp.{name}_proj.weight"] = _rows(out[f"{p}mlp.{name}_proj.weight"], rank, tp)
        out[p + "mlp.down_proj.weight"] = _cols(out[p + "mlp.down_proj.weight"], rank, tp)
    return out


@dataclass(slots=True)
class Comm:
    """A rank's all-reduce group (set once the ranks have met: shm.ShmGroup, or group.DistGroup over gloo /
    NCCL) and its all-reduce counters since start (benchmarks/tensor_parallel.py reads them). One per
    model, shared by its row-parallel linears."""
    group: object = None
    calls: int = 0
    bytes: int = 0
    seconds: float = 0.0
    # Benchmarks only (TOKENFAB_TP_MEASURE_WAIT=1, inherited by every rank, or they would disagree on
    # the collectives): a 1-element all-reduce first, so `wait_seconds` holds the time spent waiting
    # for the slower rank and `seconds` the all-reduce itself with the ranks aligned.
    measure_wait: bool = field(default_factory=lambda: os.environ.get("TOKENFAB_TP_MEASURE_WAIT") == "1")
    wait_seconds: float = 0.0

    def all_reduce(self, y: torch.Tensor) -> torch.Tensor:
        if self.group is None:
            raise RuntimeError("this tensor-parallel shard has no process group yet (engine not started)")
        if self.measure_wait:
            t0 = time.perf_counter()
            self.group.all_reduce(torch.zeros(1, dtype=y.dtype, device=y.device))
            self.wait_seconds += time.perf_counter() - t0
        t0 = time.perf_counter()
        self.group.all_reduce(y)
        self.seconds += time.perf_counter() - t0
        self.calls += 1
        self.bytes += y.numel() * y.element_size()
        return y


class RowParallel(nn.Module):
    """A row-parallel linear: this rank's partial product, then the sum over ranks (all-reduce).

    The inner linear stays a child named `linear`, so the kernel seam (pack_linears, select_kernels)
    finds and plans it like any other."""

    def __init__(self, linear: nn.Module, comm: Comm):
        super().__init__()
        self.linear = linear
        self.comm = comm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.comm.all_reduce(self.linear(x).contiguous())


def wrap_row_parallel(model) -> Comm:
    """Put the all-reduce behind every layer's o_proj and down_proj, in place; returns their shared Comm
    (also `model.tp_comm`), whose group the launcher sets once the ranks have met."""
    comm = Comm()
    for layer in model.layers:
        layer.self_attn.o_proj = RowParallel(layer.self_attn.o_proj, comm)
        layer.mlp.down_proj = RowParallel(layer.mlp.down_proj, comm)
    model.tp_comm = comm
    return comm

"""Activation-aware weight quantization (AWQ-style): calibration statistics and the scale search.

A few input channels of a linear carry much larger activations than the rest, and rounding errors
in the weights of those channels cost the most output error. AWQ scales weight column k by
s_k = mean|x_k|^alpha before quantizing (those columns then get finer steps relative to their
size) and divides the input by s_k at run time, so the float product is unchanged. alpha is
searched per layer on a small grid, minimising the output MSE on calibration activations;
alpha = 0 is plain round-to-nearest, so the search never does worse than RTN on the calibration set.

Here the 1/s factor lives in the quantized module (`Int4Linear.input_scale`), applied to x before
the matmul: always correct, at the cost of one elementwise multiply (folding it into the previous
RMSNorm would save that but needs the model's structure).
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from tokenfab.quant.schemes import dequantize_int4, quantize_int4


@dataclass
class ActivationStats:
    """Per-linear calibration data: mean |x| per input channel over all rows seen, and a row sample."""
    abs_mean: torch.Tensor      # [in]
    sample: torch.Tensor        # [rows, in], rows <= max_rows
    rows_seen: int


class ActivationCollector:
    """Forward pre-hooks on named linears that record their inputs; use as a context manager."""

    def __init__(self, model: nn.Module, names: Iterable[str], max_rows: int = 256, seed: int = 0):
        self.model, self.names, self.max_rows = model, list(names), max_rows
        self.gen = torch.Generator().manual_seed(seed)
        self._sum: dict[str, torch.Tensor] = {}
        self._buf: dict[str, torch.Tensor] = {}
        self._seen: dict[str, int] = {}
        self._handles: list = []

    def __enter__(self) -> "ActivationCollector":
        for name in self.names:
            mod = self.model.get_submodule(name)
            self._handles.append(mod.register_forward_pre_hook(self._hook(name)))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _hook(self, name: str):
        def hook(module, inputs):
            x = inputs[0].detach().reshape(-1, inputs[0].shape[-1]).float().cpu()
            self._add(name, x)
        return hook

    def _add(self, name: str, x: torch.Tensor) -> None:
        seen = self._seen.get(name, 0)
        self._sum[name] = self._sum.get(name, 0) + x.abs().sum(dim=0)
        buf = self._buf.get(name, x[:0])
        room = max(self.max_rows - buf.shape[0], 0)
        buf = torch.cat([buf, x[:room]]) if room else buf
        rest = x[room:]
        if rest.shape[0]:
            # reservoir sampling: row number i (0-based, over all calls) takes a random slot with
            # probability max_rows / (i + 1), so the kept rows are a uniform sample of all rows
            first = seen + min(room, x.shape[0])
            idx = torch.arange(first, first + rest.shape[0])
            slot = (torch.rand(rest.shape[0], generator=self.gen) * (idx + 1)).long()
            keep = slot < self.max_rows
            buf[slot[keep]] = rest[keep]
        self._buf[name] = buf
        self._seen[name] = seen + x.shape[0]

    def stats(self) -> dict[str, ActivationStats]:
        return {n: ActivationStats(self._sum[n] / self._seen[n], self._buf[n], self._seen[n])
                for n in self._seen}


def collect_activations(model: nn.Module, names: Iterable[str], calib: Callable[[nn.Module], object],
                        max_rows: int = 256) -> dict[str, ActivationStats]:
    """Run `calib(model)` (which does forward passes on calibration text) with hooks on `names`."""
    names = list(names)
    with torch.no_grad(), ActivationCollector(model, names, max_rows) as col:
        calib(model)
    stats = col.stats()
    missing = [n for n in names if n not in stats]
    if missing:
        raise ValueError(f"calibration never ran these linears: {missing[:5]}{'...' if len(missing) > 5 else ''} "
                         "(does calib(model) call the model's forward?)")
    return stats


@dataclass
class AWQResult:
    input_scale: torch.Tensor       # multiply x by this; the weight to quantize is weight / input_scale
    alpha: float
    mse: float                      # output MSE at the chosen alpha
    mse_rtn: float                  # output MSE of plain round-to-nearest (alpha = 0)


def awq_scale_candidates(abs_mean: torch.Tensor, alpha: float) -> torch.Tensor:
    """s = mean|x|^alpha, normalised so that max(s) * min(s) = 1 (AWQ's convention)."""
    a = abs_mean.float().clamp(min=abs_mean.max().item() * 1e-5 + 1e-12)
    s = a.pow(alpha)
    return s / (s.max() * s.min()).sqrt()


def search_awq_scale(weight: torch.Tensor, stats: ActivationStats, group_size: int, grid: int = 11) -> AWQResult:
    """Pick alpha in {0, 1/(grid-1), ..., 1} minimising ||X W^T - (X / s) Q(W s)^T||² on the sample."""
    w = weight.detach().float()
    x = stats.sample.float()
    ref = F.linear(x, w)
    best: AWQResult | None = None
    mse_rtn = float("nan")
    for i in range(grid):
        alpha = i / (grid - 1) if grid > 1 else 0.0
        s = awq_scale_candidates(stats.abs_mean, alpha)
        q, sc, z = quantize_int4(w * s[None, :], group_size)
        wq = dequantize_int4(q, sc, z, group_size, w.shape[1])
        mse = (F.linear(x / s[None, :], wq) - ref).pow(2).mean().item()
        if i == 0:
            mse_rtn = mse
        if best is None or mse < best.mse:
            best = AWQResult(1.0 / s, alpha, mse, mse_rtn)
    assert best is not None
    best.mse_rtn = mse_rtn
    return best

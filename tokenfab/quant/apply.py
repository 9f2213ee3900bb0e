"""Quantize a model in place: swap its `nn.Linear` modules for quantized ones, by qualified name.

    summary = quantize_model(model, "int4-g32")                         # RTN, lm_head kept float
    summary = quantize_model(model, "awq-int4-g128", calib=run_calib)   # run_calib(model) does forwards
    summary = quantize_model(model, "int8", keep_float=["lm_head", "layers.0"])

`keep_float` patterns match dotted names component-wise, with shell wildcards per component:
"lm_head" matches "lm_head" and "model.lm_head"; "layers.0" matches everything in block 0;
"layers.*.mlp.down_proj" matches every down projection. None means `DEFAULT_KEEP_FLOAT`
(embeddings and LM head, the usual mixed-precision choice); an explicit list replaces it.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from fnmatch import fnmatchcase

import torch
import torch.nn as nn

from tokenfab.quant.awq import ActivationStats, collect_activations, search_awq_scale
from tokenfab.quant.linear import Int4Linear, Int8Linear, QuantLinear, W8A8Linear
from tokenfab.quant.schemes import KQUANT_FALLBACK, QuantScheme, parse_scheme

DEFAULT_KEEP_FLOAT = ("lm_head", "embed_tokens", "token_embd", "output", "wte")

Calibration = Callable[[nn.Module], object] | Mapping[str, ActivationStats]


def name_matches(name: str, pattern: str) -> bool:
    """True if the pattern's components match a contiguous run of the name's components."""
    parts, pat = name.split("."), pattern.split(".")
    return any(all(fnmatchcase(parts[i + j], p) for j, p in enumerate(pat))
               for i in range(len(parts) - len(pat) + 1))


def linear_names(model: nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]


def set_submodule(model: nn.Module, name: str, module: nn.Module) -> nn.Module:
    """Replace the submodule at a dotted name; returns the old one."""
    parent_name, _, leaf = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    old = getattr(parent, leaf)
    setattr(parent, leaf, module)
    return old


def quantize_linear(linear: nn.Linear, scheme: QuantScheme | str, input_scale: torch.Tensor | None = None) -> QuantLinear:
    """One quantized replacement for `linear` (AWQ schemes need the `input_scale` from the search)."""
    scheme = parse_scheme(scheme) if isinstance(scheme, str) else scheme
    w, b = linear.weight.detach(), None if linear.bias is None else linear.bias.detach()
    if scheme.kquant:
        from tokenfab.quant.kquants import KQUANT_LINEAR_TYPES, QK
        if w.shape[1] % QK == 0:
            return KQUANT_LINEAR_TYPES[scheme.kquant].from_float(w, b).to(w.device)
        scheme = parse_scheme(KQUANT_FALLBACK[scheme.name])
    if scheme.bits == 8:
        q = (W8A8Linear if scheme.act8 else Int8Linear).from_float(w, b)
    else:
        q = Int4Linear.from_float(w, b, scheme.group_size, input_scale)
    return q.to(w.device)


@dataclass
class QuantizeSummary:
    scheme: str
    quantized: list[str]
    kept_float: list[str]
    keep_float_patterns: list[str]
    awq_alpha: dict[str, float] = field(default_factory=dict)
    float_bytes: int = 0          # weight bytes of the quantized linears before
    quant_bytes: int = 0          # and after


def quantize_model(model: nn.Module, scheme: str, keep_float: Sequence[str] | None = None,
                   calib: Calibration | None = None, *, awq_grid: int = 11, max_calib_rows: int = 256,
                   progress: Callable[[str], None] | None = None) -> QuantizeSummary:
    """Swap every `nn.Linear` not matched by `keep_float` for a quantized module, in place.

    `calib` (AWQ schemes only, and required there) is either a callable that runs forward passes
    of the float model on calibration text, or activation statistics collected beforehand
    (`awq.collect_activations`).
    """
    spec = parse_scheme(scheme)
    patterns = list(DEFAULT_KEEP_FLOAT if keep_float is None else keep_float)
    names = linear_names(model)
    targets = [n for n in names if not any(name_matches(n, p) for p in patterns)]
    kept = [n for n in names if n not in targets]
    if not targets:
        raise ValueError(f"no nn.Linear left to quantize: {len(names)} found, all matched keep_float={patterns}")

    stats: Mapping[str, ActivationStats] | None = None
    if spec.awq:
        if calib is None:
            raise ValueError(f"scheme {spec.name} needs calibration data: pass calib=(callable running the "
                             "model on calibration text) or activation statistics, or use int4-g"
                             f"{spec.group_size} for plain round-to-nearest")
        stats = calib if isinstance(calib, Mapping) else collect_activations(model, targets, calib, max_calib_rows)

    summary = QuantizeSummary(spec.name, targets, kept, patterns)
    for i, name in enumerate(targets):
        if progress:
            progress(f"[{i + 1}/{len(targets)}] {name}")
        lin = model.get_submodule(name)
        input_scale = None
        if stats is not None:
            if name not in stats:
                raise ValueError(f"no calibration statistics for {name}")
            found = search_awq_scale(lin.weight, stats[name], spec.group_size, awq_grid)
            input_scale = found.input_scale
            summary.awq_alpha[name] = found.alpha
        new = quantize_linear(lin, spec, input_scale)
        summary.float_bytes += lin.weight.numel() * lin.weight.element_size()
        summary.quant_bytes += new.weight_bytes()
        set_submodule(model, name, new)
    return summary

"""Per-layer sensitivity: the KL against the float model when only one linear (or group) is quantized.

It tells which layers to list in `--keep-float`: the few with a KL far above the rest are where
mixed precision pays. The model is given back unchanged (each layer is restored after its turn).

    rows = layer_sensitivity(model, logits_fn, "int4-g32")   # logits_fn(model) -> [T, V] logits
    for r in rows[:10]: print(r.name, r.kl_mean)
"""
from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn as nn

from tokenfab.quant.apply import DEFAULT_KEEP_FLOAT, linear_names, name_matches, quantize_linear, set_submodule
from tokenfab.quant.awq import ActivationStats, search_awq_scale
from tokenfab.quant.eval import token_stats
from tokenfab.quant.schemes import parse_scheme


@dataclass
class LayerSensitivity:
    name: str                # a linear's name, or a group's key
    layers: list[str]
    kl_mean: float
    kl_max: float
    same_top1_pct: float


def group_names(names: Sequence[str], by: str = "linear") -> dict[str, list[str]]:
    """Group linear names: "linear" (one each), "block" (by the first numeric component, e.g. layers.3),
    or "kind" (by the last component, e.g. all q_proj together)."""
    groups: dict[str, list[str]] = {}
    for n in names:
        if by == "linear":
            key = n
        elif by == "block":
            m = re.search(r"^(.*?\.\d+)(\.|$)", n)
            key = m.group(1) if m else n
        elif by == "kind":
            key = n.rsplit(".", 1)[-1]
        else:
            raise ValueError(f"group by 'linear', 'block' or 'kind', got {by!r}")
        groups.setdefault(key, []).append(n)
    return groups


@torch.no_grad()
def layer_sensitivity(model: nn.Module, logits_fn: Callable[[nn.Module], torch.Tensor], scheme: str, *,
                      names: Sequence[str] | None = None, groups: Mapping[str, Sequence[str]] | None = None,
                      base_logits: torch.Tensor | None = None, calib_stats: Mapping[str, ActivationStats] | None = None,
                      progress: Callable[[str], None] | None = None) -> list[LayerSensitivity]:
    """Quantize one linear (or one group) at a time with `scheme`, compare logits to the float model.

    `names` defaults to every nn.Linear outside DEFAULT_KEEP_FLOAT; `groups` overrides it (see
    `group_names`). AWQ schemes need `calib_stats` (from `awq.collect_activations`). Returns rows
    sorted by mean KL, most sensitive first.
    """
    spec = parse_scheme(scheme)
    if spec.awq and calib_stats is None:
        raise ValueError(f"{spec.name} needs calib_stats (awq.collect_activations) for its scale search")
    if groups is None:
        if names is None:
            names = [n for n in linear_names(model) if not any(name_matches(n, p) for p in DEFAULT_KEEP_FLOAT)]
        groups = {n: [n] for n in names}
    base = logits_fn(model) if base_logits is None else base_logits
    # KL only needs logits; the target is irrelevant here, so take the base's own argmax
    targets = base.argmax(-1)
    rows = []
    for i, (key, members) in enumerate(groups.items()):
        if progress:
            progress(f"[{i + 1}/{len(groups)}] {key}")
        originals = {}
        try:
            for name in members:
                lin = model.get_submodule(name)
                scale = None
                if spec.awq:
                    scale = search_awq_scale(lin.weight, calib_stats[name], spec.group_size).input_scale
                originals[name] = set_submodule(model, name, quantize_linear(lin, spec, scale))
            st = token_stats(base, logits_fn(model), targets)
        finally:
            for name, lin in originals.items():
                set_submodule(model, name, lin)
        rows.append(LayerSensitivity(key, list(members), st.kl.mean().item(), st.kl.max().item(),
                                     100 * st.same_top1.double().mean().item()))
    rows.sort(key=lambda r: r.kl_mean, reverse=True)
    return rows

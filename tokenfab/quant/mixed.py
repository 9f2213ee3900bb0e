"""Automatic mixed precision: per decoder linear, the smallest format (int4, int8 or float) that keeps the
whole model within a KL budget on calibration text.

1. **Sensitivity.** For every decoder linear and every format below float, the mean KL against the float
   model when only that linear is in that format (`sensitivity.layer_sensitivity`, on the calibration
   windows).
2. **Greedy choice.** Every linear starts in the smallest format. The model's KL is estimated as the sum
   of its linears' KLs. While the estimate is above the target, the linear whose move to a larger format
   removes the most estimated KL per byte added moves (to whichever larger format gives it the best
   ratio). This is the knapsack greedy by sensitivity per byte: a linear that costs much KL for few bytes
   saved stays high.
3. **Check.** The model is quantized as chosen and its real KL measured on the same windows. KL is not
   quite additive, so when the measurement is above the budget the target is tightened by the ratio
   budget / measured and step 2 continues from the current choice. All-float is KL 0, so this ends;
   the plan carries the measured KL that meets the budget.

Embeddings and the LM head stay float (`apply.DEFAULT_KEEP_FLOAT`, the output layers kept higher as the
usual mixed-precision advice has it); only the decoder's linears are chosen here.

    plan = plan_mixed_precision(model, windows, max_kl=0.01)     # model: the float decoder
    apply_formats(model, plan.formats)
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from tokenfab.quant.apply import DEFAULT_KEEP_FLOAT, linear_names, name_matches, quantize_linear, set_submodule
from tokenfab.quant.schemes import parse_scheme

FLOAT = "float"
DEFAULT_LOW = "int4-g32"
MAX_ROUNDS = 12


@dataclass
class MixedPlan:
    formats: dict[str, str]                         # linear name -> format ("int4-g32", "int8", "float")
    max_kl: float
    measured_kl: float                              # of the chosen mix, on the calibration windows
    estimated_kl: float                             # the sum of the chosen formats' sensitivities
    bytes: int                                      # weight bytes of the decoder linears as chosen
    bytes_by_format: dict[str, int]                 # of every linear in one format (int8: the all-int8 reference)
    rounds: int
    sensitivity: dict[str, dict[str, float]] = field(default_factory=dict, repr=False)

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for f in self.formats.values():
            out[f] = out.get(f, 0) + 1
        return out

    def as_dict(self) -> dict:
        return {"max_kl": self.max_kl, "measured_kl": self.measured_kl, "estimated_kl": self.estimated_kl,
                "bytes": self.bytes, "bytes_by_format": self.bytes_by_format, "rounds": self.rounds,
                "counts": self.counts(), "formats": self.formats}


def format_order(low: str) -> list[str]:
    """The candidate formats, smallest first: `low`, int8 (when low is smaller), float."""
    spec = parse_scheme(low)
    if spec.awq or spec.act8:
        raise ValueError(f"mixed precision chooses among round-to-nearest weight formats; {spec.name} is not one "
                         "(use int4-g32, int4-g64, int4-g128, q4_k, q6_k or int8)")
    return [spec.name] + (["int8"] if spec.name != "int8" else []) + [FLOAT]


def decoder_linears(model: nn.Module) -> list[str]:
    return [n for n in linear_names(model) if not any(name_matches(n, p) for p in DEFAULT_KEEP_FLOAT)]


def format_bytes(model: nn.Module, names: Sequence[str], formats: Sequence[str]) -> dict[str, dict[str, int]]:
    """Weight bytes of each linear in each format (float: as held, e.g. 4 per float32 weight)."""
    out = {}
    for n in names:
        lin = model.get_submodule(n)
        out[n] = {f: lin.weight.numel() * lin.weight.element_size() if f == FLOAT
                  else quantize_linear(lin, f).weight_bytes() for f in formats}
    return out


def choose_formats(kl: Mapping[str, Mapping[str, float]], nbytes: Mapping[str, Mapping[str, int]],
                   formats: Sequence[str], target: float, start: Mapping[str, str] | None = None) -> dict[str, str]:
    """The greedy choice (module docstring, step 2): from `start` (default: every linear in formats[0]),
    move linears up until the summed KL is at most `target` or everything is float."""
    choice = dict(start or {n: formats[0] for n in kl})
    rank = {f: i for i, f in enumerate(formats)}
    est = sum(kl[n][f] for n, f in choice.items())
    while est > target:
        best, best_ratio = None, -1.0
        for n, f in choice.items():
            for g in formats[rank[f] + 1:]:
                gain = kl[n][f] - kl[n][g]
                added = max(nbytes[n][g] - nbytes[n][f], 1)
                if gain > 0 and gain / added > best_ratio:
                    best, best_ratio = (n, g), gain / added
        if best is None:
            break
        n, g = best
        est -= kl[n][choice[n]] - kl[n][g]
        choice[n] = g
    return choice


def apply_formats(model: nn.Module, formats: Mapping[str, str]) -> dict[str, nn.Module]:
    """Quantize each linear to its format in place (float ones stay); returns the replaced float linears."""
    replaced = {}
    for n, f in formats.items():
        if f != FLOAT:
            replaced[n] = set_submodule(model, n, quantize_linear(model.get_submodule(n), f))
    return replaced


def _mean_kl(model, logits_fn, base: torch.Tensor) -> float:
    from tokenfab.quant.eval import token_stats
    return token_stats(base, logits_fn(model), base.argmax(-1)).kl.mean().item()


@torch.no_grad()
def plan_mixed_precision(model: nn.Module, windows: Sequence[Sequence[int]], max_kl: float, low: str = DEFAULT_LOW,
                         progress: Callable[[str], None] | None = None) -> MixedPlan:
    """Choose a format per decoder linear of the float `model` (given back unchanged) for `max_kl` on
    `windows` of calibration tokens (module docstring)."""
    from tokenfab.model.llama import full_logits
    from tokenfab.quant.sensitivity import layer_sensitivity

    if not max_kl > 0:
        raise ValueError(f"the KL budget must be positive, got {max_kl}")
    say = progress or (lambda _m: None)
    formats = format_order(low)
    names = decoder_linears(model)

    def logits_fn(m):
        return torch.cat([full_logits(m, list(w))[:-1] for w in windows])

    base = logits_fn(model)
    kl: dict[str, dict[str, float]] = {n: {FLOAT: 0.0} for n in names}
    for f in formats[:-1]:
        rows = layer_sensitivity(model, logits_fn, f, names=names, base_logits=base,
                                 progress=lambda m, f=f: say(f"sensitivity to {f} {m}"))
        for r in rows:
            kl[r.name][f] = r.kl_mean
    nbytes = format_bytes(model, names, formats)
    target, choice, measured, rounds = max_kl, None, float("inf"), 0
    while measured > max_kl and rounds < MAX_ROUNDS:
        rounds += 1
        choice = choose_formats(kl, nbytes, formats, target, choice)
        say(f"round {rounds}: measuring the chosen mix")
        replaced = apply_formats(model, choice)
        try:
            measured = _mean_kl(model, logits_fn, base)
        finally:
            for n, lin in replaced.items():
                set_submodule(model, n, lin)
        if measured > max_kl:
            if all(f == FLOAT for f in choice.values()):
                break
            target = min(target, sum(kl[n][f] for n, f in choice.items())) * max_kl / measured * 0.9
    if measured > max_kl:
        raise ValueError(f"no mix of {', '.join(formats)} met a KL of {max_kl} on the calibration text "
                         f"(the last one measured {measured:.6f}); raise --max-kl")
    by_format = {f: sum(nbytes[n][f] for n in names) for f in formats}
    return MixedPlan(choice, max_kl, measured, sum(kl[n][f] for n, f in choice.items()),
                     sum(nbytes[n][f] for n, f in choice.items()), by_format, rounds, kl)

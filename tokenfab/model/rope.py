"""RoPE's frequencies, with the scalings checkpoints ask for.

`ModelConfig.rope_scaling` is None (the default RoPE) or a dict in Hugging Face's form, `rope_type` plus
that type's parameters:
- "linear": every frequency divided by `factor` (position interpolation);
- "llama3" (Llama 3.1 / 3.2): frequencies whose wavelength exceeds `original_max_position_embeddings /
  low_freq_factor` divided by `factor`, those under `.. / high_freq_factor` kept, the band between them
  blended smoothly;
- "yarn" (Qwen2.5's long-context setting): the low frequencies interpolated, the high ones kept, a linear
  ramp between the dimensions where a frequency turns `beta_fast` and `beta_slow` times over the original
  context, and cos / sin scaled by `attention_factor` (default 0.1 ln(factor) + 1);
- "freq_factors": llama.cpp's form of a scaling (a GGUF file's `rope_freqs.weight`, what its converter writes
  for Llama 3.x): frequency i divided by `factors[i]`;
- "longrope" (Phi-3 / Phi-4-mini): frequency i divided by `short_factor[i]`, or by `long_factor[i]` when the
  context served exceeds `original_max_position_embeddings`, and cos / sin scaled by `attention_factor`
  (default sqrt(1 + ln(factor) / ln(original)), factor = max_position_embeddings / original). transformers picks
  the set per forward pass from the sequence's length; tokenfab picks it once from the context it serves
  (max_model_len), as llama.cpp does from its context size, so a sequence's keys never mix the two sets.
The formulas are the published ones (Meta's Llama 3.1 release, the YaRN paper), written so that they give
what transformers' `ROPE_INIT_FUNCTIONS` give for the same config (tests/test_rope_scaling.py).
"""
from __future__ import annotations

import math

import torch

ROPE_TYPES = ("default", "linear", "llama3", "yarn", "freq_factors", "longrope")


def normalize(scaling: dict | None, max_position_embeddings: int) -> dict | None:
    """A config's `rope_scaling` / `rope_parameters` as ModelConfig keeps it: None for the default RoPE,
    else a dict with `rope_type`; ValueError naming the types there are for anything else."""
    if not scaling:
        return None
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind in ("default", None):
        return None
    if kind not in ROPE_TYPES:
        raise ValueError(f"unsupported rope scaling {kind!r}; supported: {', '.join(ROPE_TYPES)}")
    out = {k: v for k, v in scaling.items() if k not in ("type", "rope_theta")}
    out["rope_type"] = kind
    if kind in ("linear", "llama3") and not out.get("factor"):
        raise ValueError(f"rope scaling {kind!r} needs a factor")
    if kind == "llama3":
        for key in ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
            if key not in out:
                raise ValueError(f"rope scaling 'llama3' needs {key}")
    if kind in ("yarn", "longrope"):
        out.setdefault("original_max_position_embeddings", max_position_embeddings)
        if not out.get("factor"):
            out["factor"] = max_position_embeddings / out["original_max_position_embeddings"]
    if kind == "longrope":
        for key in ("short_factor", "long_factor"):
            if not out.get(key):
                raise ValueError(f"rope scaling 'longrope' needs {key}")
        if out.get("attention_factor") is None:
            f, old = out["factor"], out["original_max_position_embeddings"]
            out["attention_factor"] = 1.0 if f <= 1 else math.sqrt(1 + math.log(f) / math.log(old))
    return out


def inverse_frequencies(head_dim: int, theta: float, scaling: dict | None,
                        context: int = 0) -> tuple[torch.Tensor, float]:
    """(inv_freq float32 [head_dim / 2], the factor cos and sin are multiplied by); `context`: the most
    positions served (longrope's choice of factors). `head_dim` is the rotated width (a partial rotary
    head's rotary dimensions)."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = (scaling or {}).get("rope_type", "default")
    if kind == "default":
        return inv, 1.0
    if kind == "linear":
        return inv / scaling["factor"], 1.0
    if kind == "freq_factors":
        factors = torch.as_tensor(scaling["factors"], dtype=torch.float32)
        if factors.numel() != inv.numel():
            raise ValueError(f"rope_freqs has {factors.numel()} factors for a head of {head_dim} ({inv.numel()} "
                             "frequencies)")
        return inv / factors, 1.0
    if kind == "llama3":
        return _llama3(inv, scaling), 1.0
    if kind == "longrope":
        key = "long_factor" if context > scaling["original_max_position_embeddings"] else "short_factor"
        factors = torch.as_tensor(scaling[key], dtype=torch.float32)
        if factors.numel() != inv.numel():
            raise ValueError(f"longrope's {key} has {factors.numel()} factors for {inv.numel()} frequencies")
        return inv / factors, float(scaling["attention_factor"])
    return _yarn(head_dim, theta, scaling)


def _llama3(inv: torch.Tensor, s: dict) -> torch.Tensor:
    factor, lo, hi = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old / lo, inv / factor, inv)       # long wavelengths: interpolated
    smooth = (old / wavelen - lo) / (hi - lo)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    between = (wavelen >= old / hi) & (wavelen <= old / lo)
    return torch.where(between, blended, scaled)


def yarn_mscale(factor: float, m: float = 1.0) -> float:
    """YaRN's default attention factor, 0.1 m ln(factor) + 1 (1 for factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0


def _yarn(dim: int, theta: float, s: dict) -> tuple[torch.Tensor, float]:
    factor, old = s["factor"], s["original_max_position_embeddings"]
    attn = s.get("attention_factor")
    if attn is None:
        m, m_all = s.get("mscale"), s.get("mscale_all_dim")
        attn = yarn_mscale(factor, m) / yarn_mscale(factor, m_all) if m and m_all else yarn_mscale(factor)
    fast, slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def dim_of(rotations: float) -> float:     # the dimension whose frequency turns `rotations` times over `old`
        return dim * math.log(old / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(fast), dim_of(slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos = theta ** (torch.arange(0, dim, 2).float() / dim)
    keep = 1 - ramp                                     # 1: the original frequency, 0: interpolated
    return (1.0 / (factor * pos)) * (1 - keep) + (1.0 / pos) * keep, float(attn)

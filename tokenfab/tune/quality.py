"""Quality of a weight format and KV dtype: `tokenfab quant eval` against the full-precision model.

Measured once per (weights, KV dtype) pair and kept in the results file. The candidate is the
format's `quant eval` name (`none`, `gguf`, `int8`, `int4-g32`, ...) with the int8 KV cache where the
point uses it. Float weights with the float KV cache are the base itself: KL 0 and 100 % top-1,
with nothing to run. `quant eval` scores the KV cache as float or int8; the float16 KV cache that
`auto` picks on CPUs with tokenfab's C kernels counts as float here.
"""
from __future__ import annotations

import time


def is_base(weights: str, kv: str) -> bool:
    return weights == "none" and kv != "int8"


def measure_quality(model: str | None, weights: str, kv: str, text: str | None, ctx: int, max_windows: int) -> dict:
    if is_base(weights, kv):
        return {"kl_mean": 0.0, "same_top1_pct": 100.0, "tokens": 0, "seconds": 0.0, "exact": True}
    from tokenfab.quant.compare import evaluate
    t0 = time.perf_counter()
    res = evaluate(model, weights, text=text, ctx=ctx, max_windows=max_windows,
                   kv_cache_dtype="int8" if kv == "int8" else "auto")
    r = res.report
    return {"kl_mean": r.kl_mean, "same_top1_pct": r.same_top1_pct, "kl_p99": r.kl_p99, "ppl_ratio": r.ppl_ratio,
            "tokens": r.tokens, "seconds": round(time.perf_counter() - t0, 2), "exact": False}

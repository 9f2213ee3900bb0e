"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention (an RMSNorm over each head's q and k) with
mixture-of-experts MLPs (model/moe.py): softmax router, top `num_experts_per_tok` of `num_experts`,
renormalised when `norm_topk_prob`. `decoder_sparse_step` and `mlp_only_layers` leave some layers with the
dense MLP of width `intermediate_size`. llama.cpp's `qwen3moe` files stack each layer's experts
(`ffn_*_exps`, read per expert by the loader) and always renormalise (its graph's constant)."""
from tokenfab.model.families import Family, register


def _from_hf(cfg: dict, out) -> None:
    if cfg.get("use_sliding_window") and cfg.get("sliding_window"):
        raise ValueError("unsupported use_sliding_window=True in a Qwen3-MoE config (tokenfab runs it without a "
                         "window; set it false)")
    out.qk_norm = True
    step, dense = int(cfg.get("decoder_sparse_step", 1)), set(cfg.get("mlp_only_layers") or [])
    if step < 1:
        raise ValueError(f"decoder_sparse_step={step} must be at least 1")
    experts = cfg.get("num_experts") or cfg.get("num_local_experts") or 0
    out.set_experts(experts, int(cfg.get("num_experts_per_tok", 0)), int(cfg.get("moe_intermediate_size", 0)),
                    bool(cfg.get("norm_topk_prob", False)),
                    [i not in dense and (i + 1) % step == 0 for i in range(out.num_layers)])


register(Family("qwen3moe", ("qwen3_moe",), from_hf=_from_hf))

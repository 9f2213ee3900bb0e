"""OLMoE (allenai/OLMoE-1B-7B): the Llama decoder with mixture-of-experts MLPs (model/moe.py; 64 experts of
width `intermediate_size`, 8 per token, not renormalised unless `norm_topk_prob`) and q/k RMSNorms over the
whole q and k projections before they are split into heads (`qk_norm_full`), not per head as Qwen3's.
llama.cpp's `olmoe` files: stacked `ffn_*_exps` tensors, Q/K not permuted, no renormalisation."""
from tokenfab.model.families import Family, register


def _from_hf(cfg: dict, out) -> None:
    if cfg.get("clip_qkv") is not None:
        raise ValueError(f"unsupported clip_qkv={cfg['clip_qkv']} in an OLMoE config (tokenfab does not clamp q, k "
                         "and v)")
    out.qk_norm = out.qk_norm_full = True
    out.set_experts(int(cfg.get("num_experts", 0)), int(cfg.get("num_experts_per_tok", 0)),
                    out.intermediate_size, bool(cfg.get("norm_topk_prob", False)))


def _from_gguf(field, out) -> None:
    out.qk_norm_full = True          # the loader saw attn_q_norm and set qk_norm
    out.norm_topk_prob = False       # llama.cpp's olmoe graph: the k weights as the softmax gives them


register(Family("olmoe", ("olmoe",), from_hf=_from_hf, from_gguf=_from_gguf))

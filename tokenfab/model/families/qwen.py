"""Qwen2 / 2.5 (biases on q, k and v) and Qwen3 (an RMSNorm over each head's q and k). GGUF files show
both by their tensors (attn_q.bias, attn_q_norm), which the shared loader reads."""
from tokenfab.model.families import Family, register


def _qwen2(cfg: dict, out) -> None:
    out.qkv_bias = True


def _qwen3(cfg: dict, out) -> None:
    out.qk_norm = True


register(Family("qwen2", ("qwen2",), from_hf=_qwen2))
register(Family("qwen3", ("qwen3",), from_hf=_qwen3))

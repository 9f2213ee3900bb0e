"""Granite 3.x: the Llama decoder with four multipliers: embeddings times `embedding_multiplier`, each block's
output times `residual_multiplier` before its residual add, attention scores times `attention_multiplier`,
logits divided by `logits_scaling`. None needs a code path of its own (`configure`)."""
from tokenfab.model.families import Family, register


def configure(out, embedding: float, residual: float, attention: float, logits: float) -> None:
    """The four multipliers on a ModelConfig, in place: the residual stream is carried divided by the residual
    multiplier r (u = h / r). RMSNorm(h) with eps equals RMSNorm(u) with eps / r^2, and h + r f becomes u + f,
    so the decoder runs unchanged with the embedding scaled by embedding / r and every norm's eps divided by
    r^2; the attention multiplier is the attention scale; logits / `logits` is the final norm's weight
    divided by it (model/llama.py). `out.granite` keeps them as stated (export writes them back)."""
    out.granite = {"embedding_multiplier": embedding, "residual_multiplier": residual,
                   "attention_multiplier": attention, "logits_scaling": logits, "rms_norm_eps": out.rms_norm_eps}
    out.embed_scale = embedding / residual
    out.rms_norm_eps = out.rms_norm_eps / residual ** 2
    out.attn_scale = attention
    out.logits_scaling = logits if logits != 1.0 else None


def _from_hf(cfg: dict, out) -> None:
    configure(out, float(cfg.get("embedding_multiplier", 1.0)), float(cfg.get("residual_multiplier", 1.0)),
              float(cfg.get("attention_multiplier", 1.0)), float(cfg.get("logits_scaling", 1.0)))


def _from_gguf(field, out) -> None:        # llama.cpp's names for the four
    configure(out, float(field("granite.embedding_scale", 1.0)), float(field("granite.residual_scale", 1.0)),
              float(field("granite.attention.scale", 1.0)), float(field("granite.logit_scale", 1.0)))


register(Family("granite", ("granite",), from_hf=_from_hf, from_gguf=_from_gguf, rope_permuted=True))

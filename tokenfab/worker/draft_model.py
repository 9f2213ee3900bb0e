"""The speculative draft model (engine/spec/draft.py proposes with it): loaded, checked against the
target's tokenizer, and built with its kernels chosen as the target's are. Its KV pool has as many
blocks as the target's, so a KV block costs both models' bytes in the worker's sizing.
"""
from __future__ import annotations

import torch

from tokenfab.kernels.select import select_kernels
from tokenfab.model.layers import pack_linears, release_float_weights
from tokenfab.model.loader import load_model_files
from tokenfab.quant.kernels import KERNEL_ALIASES
from tokenfab.quant.load import build_model


def load_draft_files(path: str, target_config, target_tokenizer):
    """The draft model's files, after checking its vocabulary is the target's (ValueError if not)."""
    files = load_model_files(path)
    dv, tv = files.config.vocab_size, target_config.vocab_size
    if dv != tv:
        raise ValueError(f"speculative_config draft model {files.path} has a vocabulary of {dv} tokens but the "
                         f"target has {tv}: a draft model must use the target's tokenizer")
    try:
        same = files.tokenizer.get_vocab() == target_tokenizer.get_vocab()
    except (AttributeError, NotImplementedError):   # a tokenizer that cannot list its vocabulary
        same = True
    if not same:
        raise ValueError(f"speculative_config draft model {files.path} has {dv} tokens like the target, but its "
                         f"tokenizer maps them to different strings: a draft model must use the target's tokenizer")
    return files


def build_draft_model(files, engine_config, dtype: torch.dtype, kv_dtype: torch.dtype, max_positions: int):
    """The draft model with its kernels chosen as the engine chooses the target's (measured table,
    one-call decode stack), at most `max_num_seqs` rows per draft step."""
    cfg = engine_config
    model = build_model(files, dtype, cfg.device, cfg.block_size, max_positions, cfg.quantization)
    pack_linears(model)
    select_kernels(model, max_rows=cfg.max_num_batched_tokens, head_max_rows=cfg.max_num_seqs, head=model.lm_head,
                   autotune=cfg.kernel_autotune and cfg.device == "cpu", dtype=dtype,
                   force=KERNEL_ALIASES.get(cfg.linear_kernel, cfg.linear_kernel),
                   stack_rows=cfg.fused_decode_max_tokens if cfg.enable_fused_decode else 0)
    release_float_weights(model)
    model.set_attention_backend(model.default_backend(
        cfg.attention_backend, kv_dtype, fused_decode=cfg.enable_fused_decode,
        fused_max_tokens=cfg.fused_decode_max_tokens))
    return model

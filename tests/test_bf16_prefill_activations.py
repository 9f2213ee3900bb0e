"""bf16 activations between the cpu backend's kernels and the bf16 GEMMs (model/backends.py,
_set_bf16_feeds): norms that write bfloat16, SwiGLU on bfloat16, attention output kept bfloat16 into
o_proj. They only move where the rounding to bf16 happens, never what it rounds: the logits must be
the float32 hand-offs' bit for bit."""
import pytest
import torch

from tokenfab import kernels
from tokenfab.model.layers import RMSNorm
from tokenfab.model.llama import full_logits

pytestmark = pytest.mark.skipif(
    not kernels.enabled() or not kernels.cpu_flags() & {"amx_bf16", "avx512_bf16"},
    reason="the bf16 kernel needs tokenfab's C kernels and a CPU with bf16 units")


def test_bf16_hand_offs_give_the_float32_hand_offs_logits_bit_for_bit(bundled_files):
    from tokenfab import LLM
    llm = LLM(loaded=bundled_files, max_model_len=512, num_kv_blocks=64, kernel_autotune=False,
              linear_kernel="bf16", kv_cache_dtype="float16")
    model = llm.engine.model
    norms = [m for m in model.modules() if isinstance(m, RMSNorm) and m.feeds is not None]
    assert len(norms) == 2 * len(model.layers) and all(layer.self_attn.o_bf16 for layer in model.layers)
    assert norms[0].feeds.takes_bf16(40)
    ids = list(range(1000, 1040))
    handed_bf16 = full_logits(model, ids, kv_dtype=torch.float16)
    for n in norms:
        n.feeds = None
    for layer in model.layers:
        layer.self_attn.o_bf16 = False
    assert torch.equal(full_logits(model, ids, kv_dtype=torch.float16), handed_bf16)

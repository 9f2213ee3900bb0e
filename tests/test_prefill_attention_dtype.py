"""Prefill attention in bfloat16 on the cpu backend (EngineConfig.prefill_attention_dtype): when it is
chosen, and that it stays close to float32 and hands float32 back."""
from types import SimpleNamespace

import pytest
import torch

from tokenfab import kernels
from tokenfab.config import EngineConfig
from tokenfab.kernels.linear import Choice, LinearPlan, get
from tokenfab.model.attention import PrefillChunk
from tokenfab.model.backends import CpuPagedAttention, bf16_prefill_rows
from tokenfab.quant import kernels as _quant_kernels  # noqa: F401  (registers qgemm and the other quantized kernels)


def _model_whose_qkv_runs(*ranges):
    plan = LinearPlan([Choice(rows, get(name), None) for rows, name in ranges])
    qkv = SimpleNamespace(plan=plan)
    return SimpleNamespace(layers=[SimpleNamespace(self_attn=SimpleNamespace(qkv_proj=qkv))])


def test_auto_takes_bf16_attention_from_the_rows_where_qkv_already_runs_the_bf16_kernel(monkeypatch):
    monkeypatch.setattr(kernels, "cpu_flags", lambda: {"avx512f", "amx_bf16"})
    assert bf16_prefill_rows(_model_whose_qkv_runs((8, "qgemm"), (None, "bf16"))) == 9
    assert bf16_prefill_rows(_model_whose_qkv_runs((None, "bf16"))) == 1
    assert bf16_prefill_rows(_model_whose_qkv_runs((32, "qtile"), (None, "qbf16"))) == 33   # bf16 activations too
    assert bf16_prefill_rows(_model_whose_qkv_runs((16, "qgemm"), (None, "float"))) is None
    assert bf16_prefill_rows(_model_whose_qkv_runs((None, "onednn"))) is None      # float checkpoints stay exact
    assert bf16_prefill_rows(_model_whose_qkv_runs((8, "qgemm"), (None, "bf16")), "float32") is None
    assert bf16_prefill_rows(_model_whose_qkv_runs((None, "onednn")), "bfloat16") == 1


def test_auto_keeps_float32_attention_on_a_cpu_without_bf16_units(monkeypatch):
    monkeypatch.setattr(kernels, "cpu_flags", lambda: {"avx2", "avx512f"})
    assert bf16_prefill_rows(_model_whose_qkv_runs((8, "qgemm"), (None, "bf16"))) is None


def test_an_unknown_prefill_attention_dtype_is_refused():
    with pytest.raises(ValueError, match="prefill_attention_dtype must be auto, float32 or bfloat16"):
        EngineConfig(prefill_attention_dtype="fp8").validate()


@pytest.mark.parametrize("cached", [0, 40])
def test_bf16_prefill_attention_stays_close_to_float32_and_returns_float32(cached):
    torch.manual_seed(0)
    H, KVH, D, bs, T = 9, 3, 64, 16, 70
    ctx = cached + T
    nblocks = -(-ctx // bs)
    kc, vc = torch.randn(nblocks, bs, KVH, D), torch.randn(nblocks, bs, KVH, D)
    q, k, v = torch.randn(T, H, D), torch.randn(T, KVH, D), torch.randn(T, KVH, D)
    kc.view(-1, KVH, D)[cached:ctx], vc.view(-1, KVH, D)[cached:ctx] = k, v      # as the K/V write left them
    chunk = PrefillChunk(0, T, ctx, torch.arange(nblocks))
    attn = CpuPagedAttention(H, KVH, D, bs)
    ref = attn._prefill(q, k, v, kc, vc, chunk)
    attn.bf16_rows = T + 1                      # a shorter chunk than the threshold: float32, bit for bit
    assert torch.equal(attn._prefill(q, k, v, kc, vc, chunk), ref)
    attn.bf16_rows = T
    out = attn._prefill(q, k, v, kc, vc, chunk)
    assert out.dtype == torch.float32 and out.shape == ref.shape
    torch.testing.assert_close(out, ref, rtol=0, atol=0.05)     # bf16 inputs: ~3 significant digits
    assert not torch.equal(out, ref)


@pytest.mark.skipif(not kernels.enabled(), reason="no C compiler: the cpu attention backend cannot run")
def test_the_engine_runs_long_prompts_with_bf16_prefill_attention_close_to_float32(bundled_files):
    """End to end on the bundled model (native Q4_1 blocks): the setting reaches the cpu backend, and a
    200-token prompt prefilled with bf16 attention gives nearly the float32 attention's prompt logprobs."""
    from tokenfab import LLM, SamplingParams
    prompt = list(range(1000, 1200))
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, prompt_logprobs=0)
    runs = {}
    for dtype, rows in (("bfloat16", 1), ("float32", None)):
        llm = LLM(loaded=bundled_files, max_model_len=512, num_kv_blocks=64, kernel_autotune=False,
                  prefill_attention_dtype=dtype)
        assert llm.engine.model.attention_backend.cpu_paged.bf16_rows == rows
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        assert len(out.outputs[0].token_ids) == 4
        runs[dtype] = torch.tensor([next(iter(lp.values())).logprob for lp in out.prompt_logprobs[1:]])
        assert llm.engine.block_manager.num_used_blocks() == 0
    assert (runs["bfloat16"] - runs["float32"]).abs().max() < 0.5

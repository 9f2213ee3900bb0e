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


def test_token_rows_make_every_query_token_a_decode_kernel_row():
    """Decodes keep their table and context; a prefill chunk's tokens share their sequence's table and
    each attends to one more position than the one before (a chunk after 5 cached tokens starts at 6)."""
    from tokenfab.model.attention import AttentionMetadata, token_rows
    meta = AttentionMetadata(slot_mapping=torch.arange(7), num_decode_tokens=2,
                             decode_block_tables=torch.tensor([[3, 4], [5, 0]]), decode_context_lens=torch.tensor([20, 9]),
                             decode_max_context=20,
                             prefills=[PrefillChunk(2, 3, 3, torch.tensor([7])), PrefillChunk(5, 2, 7, torch.tensor([8, 9, 10]))])
    bt, ctx = token_rows(meta)
    assert bt.tolist() == [[3, 4, 0], [5, 0, 0], [7, 0, 0], [7, 0, 0], [7, 0, 0], [8, 9, 10], [8, 9, 10]]
    assert ctx.tolist() == [20, 9, 1, 2, 3, 6, 7]
    assert token_rows(meta)[0] is bt                 # built once per step


@pytest.mark.skipif(not kernels.enabled(), reason="no C compiler: the cpu attention backend cannot run")
@pytest.mark.parametrize("kv_cache_dtype", ["float32", "float16"])
def test_short_prefill_chunks_through_the_decode_kernel_give_sdpas_results(bundled_files, monkeypatch, kv_cache_dtype):
    """Prompts of 3-40 tokens prefilled together, one of them after a cached prefix (a chunk with context
    before it), and later ones beside running decodes: with paged_prefill_max_context (the default) every
    step's attention is one decode-kernel call; with 0, SDPA per chunk. Both float32: the same prompt
    logprobs to float rounding, the same greedy tokens, and the kernel path was taken. (With float16
    pools a last-bit difference upstream can flip a K/V value's rounding, 2^-11 relative: a looser bound.)"""
    from tokenfab import LLM, SamplingParams
    from tokenfab.model import backends
    used = []
    real = backends.token_rows
    monkeypatch.setattr(backends, "token_rows", lambda meta: (used.append(len(meta.prefills)), real(meta))[1])
    shared = list(range(2000, 2032))
    prompts = [list(range(1000, 1040)), [5, 6, 7], shared + [11, 12], shared + [13, 14, 15], list(range(3000, 3020))]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, prompt_logprobs=0)
    runs = {}
    for limit in (128, 0):
        llm = LLM(loaded=bundled_files, max_model_len=256, num_kv_blocks=128, kernel_autotune=False,
                  prefill_attention_dtype="float32", kv_cache_dtype=kv_cache_dtype, paged_prefill_max_context=limit)
        assert llm.engine.model.attention_backend.paged_prefill_max_context == limit
        used.clear()
        llm.generate(prompts[2:3], params, use_tqdm=False)            # caches the shared prefix
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert bool(used) == (limit > 0)
        runs[limit] = [(o.outputs[0].token_ids,
                        torch.tensor([next(iter(lp.values())).logprob for lp in o.prompt_logprobs[1:]])) for o in outs]
        assert llm.engine.block_manager.num_used_blocks() == 0
    for (tok_k, lp_k), (tok_s, lp_s) in zip(runs[128], runs[0]):
        assert tok_k == tok_s
        torch.testing.assert_close(lp_k, lp_s, rtol=0, atol=2e-4 if kv_cache_dtype == "float32" else 5e-3)


def test_a_negative_paged_prefill_max_context_is_refused():
    with pytest.raises(ValueError, match="paged_prefill_max_context must be a non-negative integer"):
        EngineConfig(paged_prefill_max_context=-1).validate()

"""Quantization inside the engine, on the bundled model: quality against the float ("none") model,
native GGUF blocks, quantized checkpoints through LLM(model=DIR), and the int8 KV cache."""
import pytest
import torch

from tokenfab import LLM, SamplingParams
from tokenfab.model.attention import kv_bytes_per_token, kv_int8_bytes_per_token
from tokenfab.model.llama import full_logits
from tokenfab.quant.compare import evaluate, full_logits_int8_kv
from tokenfab.quant.eval import compare_logits, next_token_targets
from tokenfab.quant.export import quantize_to_folder
from tokenfab.quant.linear import Int4Linear, QuantLinear, set_kernel
from tokenfab.quant.text import split_eval_calib, text_token_ids, token_windows

PROMPT = "The GNU General Public License is a free, copyleft license for software and other kinds of works."
# Greedy-output prompts for the KV cache test: varied kinds of text.
PROMPTS = ["The capital of France is", "Write a haiku about the sea.", "def fibonacci(n):",
           "Once upon a time, in a small village,", "The three primary colors are",
           "Explain photosynthesis in one sentence.", "1, 2, 3, 4,", "The quick brown fox"]


pytestmark = pytest.mark.usefixtures("one_thread")


def _llm(files, **kw):
    # a small pool: these tests look at logits and short generations, never at capacity
    return LLM(loaded=files, num_kv_blocks=kw.pop("num_kv_blocks", 64), **kw)


@pytest.fixture(scope="module")
def float_llm(bundled_files):
    # float32 prefill attention: on CPUs with bf16 units "auto" takes bf16 there, which is not the reference
    return _llm(bundled_files, quantization="none", prefill_attention_dtype="float32")


@pytest.fixture(scope="module")
def prompt_ids(bundled_tokenizer):
    return bundled_tokenizer(PROMPT).input_ids


# --------------------------------------------------------------------------- weight-only quality

def test_int8_weights_keep_mean_kl_below_001_and_top1_above_95pct_on_the_evaluation_text(bundled_files):
    # 3 windows of 512 tokens (1,533 scored) from the evaluation slice: enough for a standard error
    # on same-top-1 of about 0.5 points, and deterministic (the same tokens every run)
    res = evaluate(None, "int8", ctx=512, max_windows=3, base_files=bundled_files)
    r = res.report
    print(f"\nint8 vs float: {r.tokens} tokens, KL {r.kl_mean:.5f} ± {r.kl_stderr:.5f}, "
          f"same top-1 {r.same_top1_pct:.2f} ± {r.same_top1_stderr_pct:.2f} %, PPL ratio {r.ppl_ratio:.4f}")
    assert r.tokens == 3 * 511
    assert r.kl_mean < 0.01
    assert r.same_top1_pct > 95.0


def test_evaluation_windows_never_overlap_the_calibration_slice(bundled_tokenizer):
    ids = text_token_ids(bundled_tokenizer)
    ev, cal = split_eval_calib(ids)
    assert ev + cal == ids and len(cal) > 4 * 512
    windows = token_windows(ev, 512)
    assert sum(map(len, windows)) <= len(ev)     # every evaluation window lies in the first slice


# --------------------------------------------------------------------------- native GGUF blocks

def test_native_gguf_blocks_give_float_logits_at_bf16_precision(bundled_files, float_llm, prompt_ids):
    # the packed kernel on every CPU (a measured table may take bf16 copies or AMX tiles instead), and the
    # reference's float32 attention: the error asserted is the bf16 activations' alone
    gguf = _llm(bundled_files, quantization="gguf", linear_kernel="packed", prefill_attention_dtype="float32").engine.model
    assert sum(isinstance(m, QuantLinear) for m in gguf.modules()) == 30 * 4 + 1     # every linear + LM head
    ref = full_logits(float_llm.engine.model, prompt_ids)
    got = full_logits(gguf, prompt_ids)           # the packed kernels (bf16 activations)
    # bf16 rounding of activations in 30 layers: a few % of the logit range, never a changed ranking
    torch.testing.assert_close(got, ref, rtol=0, atol=0.05 * float(ref.abs().max()))
    rows, targets = next_token_targets(torch.tensor(prompt_ids))
    assert compare_logits(ref[rows], got[rows], targets).kl_mean < 0.005

    set_kernel(gguf, "dequant")                   # expand the blocks, then F.linear in float32
    # float32 throughout; the float model's GEMM (oneDNN or MKL, whichever the kernel table measured
    # faster per shape) sums in another order: equal to float32 rounding
    torch.testing.assert_close(full_logits(gguf, prompt_ids), ref, rtol=0, atol=2e-5 * float(ref.abs().max()))


# --------------------------------------------------------------------------- checkpoints

@pytest.fixture(scope="module")
def int4_folder(bundled_files, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("ckpt") / "int4-g32")
    res = quantize_to_folder(None, "int4-g32", out, files=bundled_files)
    assert res.quantized == 30 * 4 and res.kept_float == ["lm_head"]
    return out


def test_quantized_checkpoint_round_trips_through_llm_model_dir(bundled_files, int4_folder, prompt_ids):
    # the default rules for both: two measured tables can differ where kernels nearly tie (a busy machine)
    loaded = LLM(model=int4_folder, num_kv_blocks=64, kernel_autotune=False)
    in_memory = _llm(bundled_files, quantization="int4-g32", kernel_autotune=False)
    m = loaded.engine.model
    assert isinstance(m.layers[0].mlp.down_proj, Int4Linear)
    assert m.lm_head.weight is m.embed_tokens.weight                  # tie kept, one copy in memory
    assert loaded.engine.model_config == bundled_files.config          # config.json reads back unchanged
    torch.testing.assert_close(full_logits(m, prompt_ids), full_logits(in_memory.engine.model, prompt_ids),
                               rtol=0, atol=0)
    sp = SamplingParams(max_tokens=8, temperature=0)
    assert (loaded.generate([PROMPT], sp, use_tqdm=False)[0].outputs[0].token_ids
            == in_memory.generate([PROMPT], sp, use_tqdm=False)[0].outputs[0].token_ids)


def test_checkpoint_loads_in_bfloat16_with_float_parameters_cast(int4_folder):
    m = LLM(model=int4_folder, dtype="bfloat16", num_kv_blocks=16).engine.model
    assert m.embed_tokens.weight.dtype == torch.bfloat16 and m.norm.weight.dtype == torch.bfloat16
    assert m.layers[0].mlp.down_proj.scales.dtype == torch.float32     # quantized layers keep their scales


def test_checkpoint_is_refused_with_another_weight_quantization(int4_folder):
    with pytest.raises(ValueError, match="already quantized"):
        LLM(model=int4_folder, quantization="int8", num_kv_blocks=16)


# --------------------------------------------------------------------------- int8 KV cache

def test_int8_kv_cache_keeps_greedy_output_on_most_prompts_and_small_kl(bundled_files, float_llm, bundled_tokenizer):
    sp = SamplingParams(max_tokens=12, temperature=0)
    int8 = _llm(bundled_files, quantization="none", kv_cache_dtype="int8")
    ref = [o.outputs[0].token_ids for o in float_llm.generate(PROMPTS, sp, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in int8.generate(PROMPTS, sp, use_tqdm=False)]
    same = sum(a == b for a, b in zip(ref, got))

    window = token_windows(split_eval_calib(text_token_ids(bundled_tokenizer))[0], 128, 1)[0]
    rows, targets = next_token_targets(torch.tensor(window))
    model = float_llm.engine.model
    r = compare_logits(full_logits(model, window)[rows], full_logits_int8_kv(model, window)[rows], targets)
    print(f"\nint8 KV: greedy output identical on {same}/{len(PROMPTS)} prompts (12 tokens); "
          f"KL {r.kl_mean:.5f} ± {r.kl_stderr:.5f}, same top-1 {r.same_top1_pct:.1f} % over {r.tokens} tokens")
    assert same > len(PROMPTS) // 2
    assert r.kl_mean < 0.01
    assert int8.engine.block_manager.num_used_blocks() == 0


def test_int8_kv_cache_doubles_the_block_pool_at_the_same_memory(bundled_files):
    budget = 8 << 20
    blocks = {}
    for name, kw in {"float32": {"kv_cache_dtype": "float32"}, "bfloat16": {"dtype": "bfloat16"},
                     "int8": {"kv_cache_dtype": "int8"}}.items():
        llm = LLM(loaded=bundled_files, quantization="none", kv_cache_memory_bytes=budget, **kw)
        blocks[name] = llm.engine.stats().num_blocks
        assert llm.engine.scheduler.bm.num_blocks == blocks[name]     # what the scheduler admits into
    cfg = bundled_files.config
    assert blocks["int8"] == budget // (16 * kv_int8_bytes_per_token(cfg))
    assert 1.8 < blocks["int8"] / blocks["bfloat16"] <= 2.0           # int8 + a float32 scale per 64 values
    assert 3.6 < blocks["int8"] / blocks["float32"] <= 4.0
    assert kv_bytes_per_token(cfg, torch.bfloat16) == cfg.kv_bytes_per_token(2)

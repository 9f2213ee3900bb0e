"""Gemma 3 (the decoder's gemma3 configuration): greedy output token-exact against transformers on a tiny
random Gemma 3 with a sliding window of 16 (prompts longer than the window, so it slides), the same
tokens batched, chunked, preempted and with prefix-cache hits, each attention backend; the same again
with the sliding layers' own pool smaller than the global one (engine/sliding_kv.py), speculative
decoding and the int8 cache included; and the real Gemma 3 270M Q4_K_M file (slow)."""
import json
import os

import pytest
import torch

from tests.oracle import hf_greedy
from tokenfab import LLM, SamplingParams, kernels
from tokenfab.worker.kv_sizing import per_sequence_blocks

NEW_TOKENS = 40
WINDOW = 16


@pytest.fixture(scope="module")
def tiny_gemma3(tmp_path_factory, bundled_tokenizer):
    """A random Gemma3ForCausalLM (7 layers: 5 sliding, 1 global, 1 sliding), norms randomized so that
    the (1 + weight) offset matters, query_pre_attn_scalar unlike head_dim; saved as an HF folder."""
    from transformers import AutoModelForCausalLM, Gemma3TextConfig

    folder = str(tmp_path_factory.mktemp("gemma3"))
    cfg = Gemma3TextConfig(vocab_size=len(bundled_tokenizer), hidden_size=64, intermediate_size=128,
                           num_hidden_layers=7, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                           sliding_window=WINDOW, query_pre_attn_scalar=24, max_position_embeddings=1024,
                           initializer_range=0.2, bos_token_id=bundled_tokenizer.bos_token_id,
                           eos_token_id=bundled_tokenizer.eos_token_id, pad_token_id=0)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(0, 0.3)
    model.save_pretrained(folder)
    bundled_tokenizer.save_pretrained(folder)
    with open(os.path.join(folder, "config.json")) as f:
        assert json.load(f)["model_type"] == "gemma3_text"
    return folder, model


PROMPTS = [list(range(200, 240)), [5, 17, 300, 4000, 99, 12], list(range(1000, 1070, 2)) * 2]
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def hf_reference(tiny_gemma3):
    _, hf = tiny_gemma3
    return [hf_greedy(hf, p, NEW_TOKENS) for p in PROMPTS]


def _run(llm, prompts=PROMPTS):
    out = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    assert llm.engine.block_manager.num_used_blocks() == 0
    return out


def test_gemma3_config_reads_the_switches(tiny_gemma3):
    from tokenfab.model.loader import load_model_files
    cfg = load_model_files(tiny_gemma3[0]).config
    assert cfg.arch == "gemma3" and cfg.sliding_window == WINDOW and cfg.hidden_act == "gelu_pytorch_tanh"
    assert cfg.sliding_layers == [True] * 5 + [False, True]
    assert (cfg.rope_theta, cfg.rope_local_theta) == (1000000.0, 10000.0)
    assert cfg.attn_scale == 24 ** -0.5 and cfg.embed_scale == 64 ** 0.5 and cfg.norm_offset == 1.0


@pytest.mark.parametrize("backend", ["torch", "cpu", "torch-no-c"])
def test_tiny_gemma3_matches_transformers_alone_and_batched(tiny_gemma3, hf_reference, backend, monkeypatch):
    if backend == "cpu" and not kernels.enabled():
        pytest.skip("tokenfab's C kernels are not built here")
    if backend == "torch-no-c":          # the portable path (gather + masked SDPA), as CUDA runs it
        monkeypatch.setattr(kernels, "usable", lambda *tensors: False)
        backend = "torch"
    llm = LLM(model=tiny_gemma3[0], max_model_len=512, num_kv_blocks=64, attention_backend=backend)
    assert all(len(p) > WINDOW for p in (PROMPTS[0], PROMPTS[2]))
    assert _run(llm) == hf_reference                                   # batched
    assert [_run(llm, [p])[0] for p in PROMPTS] == hf_reference        # alone


def test_tiny_gemma3_chunked_prefill_matches_transformers(tiny_gemma3, hf_reference):
    llm = LLM(model=tiny_gemma3[0], max_model_len=512, num_kv_blocks=64, max_num_batched_tokens=12)
    assert _run(llm) == hf_reference


def test_tiny_gemma3_preemption_matches_transformers(tiny_gemma3, hf_reference):
    llm = LLM(model=tiny_gemma3[0], max_model_len=128, num_kv_blocks=10, block_size=16)
    assert _run(llm) == hf_reference
    assert llm.engine.scheduler.num_preemptions > 0


def test_tiny_gemma3_prefix_cache_hits_match_transformers(tiny_gemma3):
    _, hf = tiny_gemma3
    shared = list(range(300, 348))                                    # 3 blocks, longer than the window
    prompts = [shared + [7, 8, 9], shared + [11, 12]]
    llm = LLM(model=tiny_gemma3[0], max_model_len=512, num_kv_blocks=64)
    first = _run(llm, prompts[:1])
    second = _run(llm, prompts[1:])
    assert llm.engine.stats().prefix_cache_hits >= 32
    assert first + second == [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]


# ------------------------------------------------------------------ the one-call decode stack (tf_decode_layers)
def _dequantized_hf(hf, model):
    """A copy of the HF model holding the weights tokenfab's quantized layers represent (q/k/v and
    gate/up split back out), so transformers is the oracle for the quantized engine too."""
    import copy
    ref = copy.deepcopy(hf)
    cfg = model.config
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    with torch.no_grad():
        for ours, theirs in zip(model.layers, ref.model.layers):
            a, t = ours.self_attn, theirs.self_attn
            qkv = a.qkv_proj.dequantize()
            for proj, w in zip((t.q_proj, t.k_proj, t.v_proj), qkv.split([q, kv, kv])):
                proj.weight.copy_(w)
            t.o_proj.weight.copy_(a.o_proj.dequantize())
            gate, up = ours.mlp.gate_up_proj.dequantize().split(cfg.intermediate_size)
            theirs.mlp.gate_proj.weight.copy_(gate)
            theirs.mlp.up_proj.weight.copy_(up)
            theirs.mlp.down_proj.weight.copy_(ours.mlp.down_proj.dequantize())
    return ref


@pytest.mark.skipif(not kernels.enabled(), reason="tokenfab's C kernels are not built here")
@pytest.mark.parametrize("sliding_pool", [True, False])
def test_one_call_decode_stack_runs_gemma3_and_matches_transformers_and_the_layer_path(tiny_gemma3, monkeypatch,
                                                                                       sliding_pool):
    """int8 weights (tf_qgemm layouts) on the cpu backend: decode steps of up to 16 rows run the whole
    Gemma 3 stack in one tf_decode_layers call (q/k norms, four norms, GeGLU, sliding layers reading
    their window, from their own pool or the global one). Greedy tokens, alone and batched, with
    prompts past the window, equal transformers on the weights the int8 layers represent, and tokens
    and logprobs equal the layer-by-layer path's."""
    folder, hf = tiny_gemma3
    llm = LLM(model=folder, quantization="int8", attention_backend="cpu", kernel_autotune=False,
              max_model_len=512, num_kv_blocks=64, sliding_window_pool=sliding_pool)
    backend = llm.engine.model.attention_backend
    calls = []
    decode_layers = kernels.decode_layers
    monkeypatch.setattr(kernels, "decode_layers", lambda x, *a, **k: (calls.append(x.shape[0]), decode_layers(x, *a, **k)))
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=2)

    def run(prompts):
        out = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(prompts, params)]
        assert llm.engine.block_manager.num_used_blocks() == 0
        return out

    batched = run(PROMPTS)
    assert backend.stack_rows >= len(PROMPTS) and len(PROMPTS) in calls, "the batched decodes missed the stack"
    calls.clear()
    alone = [run([p])[0] for p in PROMPTS]
    assert calls and set(calls) == {1}
    ref = _dequantized_hf(hf, llm.engine.model)
    want = [hf_greedy(ref, p, NEW_TOKENS) for p in PROMPTS]
    assert [t for t, _ in batched] == want
    assert [t for t, _ in alone] == want
    backend.fused_decode = False                     # the same steps, layer by layer
    calls.clear()
    assert run(PROMPTS) == batched and not calls


# ------------------------------------------------------------------ the sliding-window pool (engine/sliding_kv.py)
BS = 4          # small blocks: the window spans four of them, so blocks really fall out of it
SMALL = dict(block_size=BS, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=512)


def _llm(folder, **kw):
    return LLM(model=folder, **{**SMALL, **kw})


def _generate(llm, prompts, params=GREEDY):
    out = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert llm.engine.block_manager.num_used_blocks() == 0       # both pools
    return out


def _spy_held(llm) -> list[int]:
    """Record, at every step, the most sliding blocks any scheduled sequence holds."""
    held, runner = [], llm.engine.runner
    prepare = runner.prepare

    def spy(batch):
        held.append(max(runner.sliding.held(s) for s in batch.seqs))
        return prepare(batch)
    runner.prepare = spy
    return held


def test_sliding_pool_is_smaller_and_batched_chunked_output_matches_transformers(tiny_gemma3, hf_reference):
    llm = _llm(tiny_gemma3[0], num_kv_blocks=200)
    sliding = llm.engine.block_manager.sliding
    assert sliding is not None and sliding.num_blocks < 200 / 4
    held = _spy_held(llm)
    assert _generate(llm, PROMPTS) == hf_reference
    assert max(held) <= per_sequence_blocks(WINDOW, BS, SMALL["max_num_batched_tokens"])


def test_sliding_pool_with_preemption_matches_transformers(tiny_gemma3, hf_reference):
    llm = _llm(tiny_gemma3[0], num_kv_blocks=30)          # 120 tokens: the 110-token sequence evicts the others
    assert _generate(llm, PROMPTS) == hf_reference
    assert llm.engine.scheduler.num_preemptions > 0


def test_sliding_pool_with_prefix_hits_matches_transformers(tiny_gemma3):
    _, hf = tiny_gemma3
    shared = list(range(300, 348))
    prompts = [shared + [7, 8, 9], shared + [11, 12]]
    llm = _llm(tiny_gemma3[0], num_kv_blocks=200)
    got = _generate(llm, prompts[:1]) + _generate(llm, prompts[1:])
    assert llm.engine.stats().prefix_cache_hits >= 40
    assert got == [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]


@pytest.mark.parametrize("spec", [
    pytest.param({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "adaptive": False}, id="ngram"),
    pytest.param({"method": "layerskip", "num_speculative_tokens": 2, "num_layers": 3, "adaptive": False}, id="layerskip")])
def test_sliding_pool_with_speculative_decoding_matches_transformers(tiny_gemma3, hf_reference, spec):
    llm = _llm(tiny_gemma3[0], num_kv_blocks=200, speculative_config=spec)
    assert _generate(llm, PROMPTS) == hf_reference
    assert llm.engine.stats().spec_decode_num_drafts > 0


@pytest.mark.parametrize("kv", ["auto", "int8"])
def test_long_generation_is_the_same_with_and_without_the_sliding_pool(tiny_gemma3, kv):
    """A 100-token prompt and 100 new tokens (the window slides ~12 times over), two at once."""
    prompts = [list(range(400, 500)), list(range(700, 790))]
    params = SamplingParams(max_tokens=100, temperature=0, ignore_eos=True)
    outs = [_generate(_llm(tiny_gemma3[0], num_kv_blocks=300, kv_cache_dtype=kv, sliding_window_pool=on),
                      prompts, params) for on in (True, False)]
    assert outs[0] == outs[1]


def test_kv_sizing_counts_the_sliding_pool_savings(tiny_gemma3):
    """The same KV memory holds more tokens when the sliding layers keep only their window, and
    `tokenfab info` reports the same rule."""
    from tokenfab.worker.kv_sizing import sliding_savings
    kw = dict(kv_cache_memory_bytes=4 << 20, max_num_seqs=2, max_model_len=1024)
    on, off = (_llm(tiny_gemma3[0], sliding_window_pool=p, **kw).engine for p in (True, False))
    assert off.block_manager.sliding is None
    assert on.block_manager.num_blocks > 3 * off.block_manager.num_blocks     # 6 of 7 layers slide
    assert on.kv_pool_bytes <= 4 << 20 and off.kv_pool_bytes <= 4 << 20
    saved = sliding_savings(on.model_config, on.config, on.kv_bytes_per_token)
    assert saved["kv_tokens_per_gib_float32"]["sliding pool, max_num_seqs 2"] > \
        3 * saved["kv_tokens_per_gib_float32"]["all positions"]
    assert saved["kv_bytes_8k_float32_held"] < saved["kv_bytes_8k_float32_all_positions"] / 3


# ------------------------------------------------------------------------------- the real file
def gemma3_270m_path() -> str:
    try:
        from tokenfab.files.bundled import gemma3_270m_path as find
        return find()
    except FileNotFoundError as e:
        pytest.skip(str(e))


@pytest.mark.slow
@pytest.mark.timeout(2400)      # transformers dequantizes the GGUF in numpy: minutes on 2 shared cores
def test_gemma3_270m_q4_k_m_matches_transformers_past_the_sliding_window():
    """The real file, float32 (quantization="none": the file's blocks dequantized, as transformers does;
    float32 KV pools, which "auto" would make float16 here): a prompt longer than the 512-token window and
    64 new tokens, token-exact."""
    from tests.oracle import load_hf_gguf
    path = gemma3_270m_path()
    llm = LLM(model="gemma3-270m", quantization="none", kv_cache_dtype="float32", max_model_len=1024,
              num_kv_blocks=128)
    text = " ".join(f"Item {i}: the {['red', 'green', 'blue'][i % 3]} box holds {i * 7 % 13} stones." for i in range(60))
    ids = llm.engine.tokenize(text)
    assert len(ids) > 512
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    got = llm.generate([ids], params)[0].outputs[0].token_ids
    assert got == hf_greedy(load_hf_gguf(path), ids, 64)

"""GGUF K-quant blocks (Q2_K..Q6_K) run as stored: the C decoder and kernels against the gguf package's
numpy dequantizers block by block, the Q4_K / Q6_K quantizers, the engine on K-quant layers, and the
one-line errors for damaged files and unknown types."""
import numpy as np
import pytest
import torch

from tokenfab import kernels
from tokenfab.quant.kquants import (BLOCK_BYTES, KQUANT_LINEAR_TYPES, QK, quantize_q4_k, quantize_q6_k,
                                    reference_dequantize)

# where each type keeps its fp16 super-scale(s) in a block: set to sane values in random blocks
_SCALE_OFFSETS = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def random_blocks(kind: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Random bytes in `kind`'s layout, uint8 [rows, cols / 256 * block bytes], with finite small scales."""
    rng = np.random.default_rng(seed)
    nb, bb = cols // QK, BLOCK_BYTES[kind]
    b = rng.integers(0, 256, size=(rows, nb, bb), dtype=np.uint8)
    for off in _SCALE_OFFSETS[kind]:
        b[..., off:off + 2] = (rng.random((rows, nb)) * 0.01 + 1e-3).astype(np.float16).view(np.uint8).reshape(rows, nb, 2)
    return b.reshape(rows, nb * bb)


needs_c = pytest.mark.skipif(not kernels.enabled(), reason="tokenfab's C kernels are not built here")


@needs_c
@pytest.mark.parametrize("kind", sorted(BLOCK_BYTES))
def test_c_decoder_matches_gguf_dequantizer_block_by_block(kind):
    rows, cols = 24, 3 * QK
    raw = random_blocks(kind, rows, cols, seed=1)
    ref = torch.from_numpy(reference_dequantize(raw, kind, rows, cols))
    layer = KQUANT_LINEAR_TYPES[kind].from_gguf(raw, rows, cols)
    got = layer.dequantize()
    torch.testing.assert_close(got, ref, rtol=0, atol=0)
    # the bf16 copy's one-pass expansion: the float32 one rounded as torch rounds it, bit for bit
    bf = layer.dequantize_bf16()
    assert bf.dtype == torch.bfloat16
    assert torch.equal(bf.view(torch.int16), ref.to(torch.bfloat16).view(torch.int16))


@needs_c
@pytest.mark.parametrize("kind", sorted(BLOCK_BYTES))
@pytest.mark.parametrize("tokens", [1, 7, 16, 17, 64, 512])
def test_each_kquant_kernel_matches_gguf_dequantize_then_float_matmul(kind, tokens):
    rows, cols = 80, 2 * QK
    raw = random_blocks(kind, rows, cols, seed=tokens)
    w = torch.from_numpy(reference_dequantize(raw, kind, rows, cols)).double()
    x = torch.randn(tokens, cols, generator=torch.Generator().manual_seed(tokens))
    ref = (x.double() @ w.T).float()
    layer = KQUANT_LINEAR_TYPES[kind].from_gguf(raw, rows, cols)
    for name in ("qgemm", "dequant", "float"):
        layer.kernel = name
        got = layer(x)
        # Q4_K's and Q6_K's qgemm on AVX2 round activations to int16 blocks of 32, as qgemm does for int4 / int8
        tol = 1e-4 if name == "qgemm" and kind in ("Q4_K", "Q6_K") and "avx2" in kernels.compiled_features() else 1e-5
        torch.testing.assert_close(got, ref, rtol=tol, atol=tol * float(ref.abs().max())), name


@pytest.mark.parametrize("rows,cols", [(8, QK), (24, 2048), (4, 8192)])   # the 1B geometry's input widths too
def test_q4_k_loads_into_int4_blocks_that_decode_to_gguf_floats_bit_for_bit(rows, cols):
    from tokenfab.quant.linear import Int4BlockLinear, gguf_linear
    raw = random_blocks("Q4_K", rows, cols, seed=cols)
    ref = torch.from_numpy(reference_dequantize(raw, "Q4_K", rows, cols))
    layer = gguf_linear(raw, "Q4_K", rows, cols)
    assert isinstance(layer, Int4BlockLinear) and layer.weight_format == "int4"
    assert torch.equal(layer.dequantize(), ref)
    ids = torch.tensor([[rows - 1, 0], [1, 1]])
    assert torch.equal(layer.embedding(ids), ref[ids])
    # 6 bits per weight: the codes and a float32 scale and offset per 32; the kernels read these buffers
    assert layer.weight_bytes() == rows * cols * 6 // 8
    q, d, m, gs, bits = layer.cpu_layout()
    assert (q.data_ptr(), d.data_ptr(), m.data_ptr(), gs, bits) == (
        layer.qweight.data_ptr(), layer.scales.data_ptr(), layer.offsets.data_ptr(), 32, 4)


@needs_c
@pytest.mark.parametrize("isa", list(kernels.ISA_VARIANTS), indirect=True)
@pytest.mark.parametrize("kind", ["Q4_K", "Q4_K stored", "Q6_K"])        # a Q4_K_M file's two types
@pytest.mark.parametrize("out_features,cols", [(64, 2048), (16, 8192)])   # the 1B geometry's input widths
def test_1b_shaped_kquant_layers_run_every_kernel_against_the_float_reference(out_features, cols, kind, isa):
    """The layers the loader builds from a file's blocks (Q4_K: int4 blocks or as stored, `blocks_as_stored`;
    Q6_K: as stored), with each kernel that takes them on this build, at 1-512 tokens."""
    from tokenfab.kernels import linear as seam
    from tokenfab.quant.linear import gguf_linear
    kind, stored = kind.split()[0], kind.endswith("stored")
    raw = random_blocks(kind, out_features, cols, seed=3)
    w = torch.from_numpy(reference_dequantize(raw, kind, out_features, cols)).double()
    layer = gguf_linear(raw, kind, out_features, cols, as_stored=stored)
    if stored:
        assert type(layer).__name__ == "Q4_KLinear" and layer.weight_bytes() == out_features * cols * 9 // 16
    ran = []
    for k in seam.registered(layer.weight_format):
        if k.supports(layer) is not None:
            continue
        layer.plan = seam.forced_plan(layer, k.name)
        ran.append(k.name)
        for tokens in (1, 7, 16, 17, 64, 512):
            x = torch.randn(tokens, cols, generator=torch.Generator().manual_seed(tokens))
            ref = (x.double() @ w.T).float()
            err = float((layer(x) - ref).abs().max() / ref.abs().max())
            assert err < (5e-2 if k.lossy else 4e-4), (k.name, tokens, err)
    assert "qgemm" in ran


@needs_c
@pytest.mark.parametrize("tokens", [1, 17, 70])
def test_qmadd_reads_blocks_as_stored_to_the_same_bits_as_its_int4_blocks(tokens):
    """tf_qmadd expands each Q4_K sub-block into what the int4 blocks hold (d * sc, -dmin * mn): the same
    outputs, bit for bit, at a quarter fewer weight bytes."""
    from tokenfab.quant.linear import gguf_linear
    if "avx2" not in kernels.compiled_features():
        pytest.skip(f"qmadd needs an AVX2 build; this one is {kernels.isa() or 'the portable C loop'}")
    raw = random_blocks("Q4_K", 48, 2 * QK, seed=tokens)
    stored, blocks = (gguf_linear(raw, "Q4_K", 48, 2 * QK, as_stored=s) for s in (True, False))
    x = torch.randn(tokens, 2 * QK, generator=torch.Generator().manual_seed(tokens))
    assert torch.equal(kernels.qmadd(x, *stored.cpu_layout(), 48), kernels.qmadd(x, *blocks.cpu_layout(), 48))


@needs_c
@pytest.mark.parametrize("tokens", [1, 17, 70])
def test_qmadd_on_q6_k_blocks_gives_qgemms_block_dots_with_rows_independent(tokens):
    """tf_qmadd expands Q6_K's codes with a scale per sub-block of 16 (no float copy for big batches): the same
    exact integer dots as qgemm's tf_kint on the same int16 activation blocks, so the two differ only in the
    order of their float sums; and a row's result does not depend on the rows beside it."""
    from tokenfab.quant.linear import gguf_linear
    if "avx2" not in kernels.compiled_features():
        pytest.skip(f"qmadd needs an AVX2 build; this one is {kernels.isa() or 'the portable C loop'}")
    raw = random_blocks("Q6_K", 48, 2 * QK, seed=tokens)
    layout = gguf_linear(raw, "Q6_K", 48, 2 * QK).cpu_layout()
    x = torch.randn(tokens, 2 * QK, generator=torch.Generator().manual_seed(tokens))
    y, ref = kernels.qmadd(x, *layout, 48), kernels.qgemm(x, *layout, 48)
    assert float((y - ref).abs().max()) <= 1e-5 * float(ref.abs().max())
    assert torch.equal(kernels.qmadd(x[tokens // 2:], *layout, 48), y[tokens // 2:])


@pytest.mark.parametrize("kind,quantize,max_rel_err", [("Q4_K", quantize_q4_k, 0.12), ("Q6_K", quantize_q6_k, 0.03)])
def test_kquant_quantizers_write_blocks_gguf_reads_back_close_to_the_weights(kind, quantize, max_rel_err):
    w = np.random.default_rng(0).standard_normal((32, 2 * QK)).astype(np.float32)
    w[3] *= 50                                # rows of very different ranges keep their own scales
    w[5, :QK] = 0                             # an all-zero super-block stays zero
    blocks = quantize(w)
    assert blocks.dtype == np.uint8 and blocks.shape == (32, 2 * BLOCK_BYTES[kind])
    back = reference_dequantize(blocks, kind, 32, 2 * QK)
    assert np.all(back[5, :QK] == 0)
    err = np.abs(back - w).mean(axis=1) / np.abs(w).mean(axis=1).clip(1e-12)
    assert err[np.arange(32) != 5].max() < max_rel_err
    layer = KQUANT_LINEAR_TYPES[kind].from_float(torch.from_numpy(w))
    torch.testing.assert_close(layer.dequantize(), torch.from_numpy(back), rtol=0, atol=0)


def test_wrong_sized_kquant_data_is_one_line_naming_the_type():
    raw = random_blocks("Q4_K", 8, QK)
    with pytest.raises(ValueError, match=r"Q4_K data for \[8, 256\] should be 1152 bytes, got 1100") as e:
        KQUANT_LINEAR_TYPES["Q4_K"].from_gguf(raw.reshape(-1)[:1100], 8, QK)
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="divisible by 256"):
        KQUANT_LINEAR_TYPES["Q6_K"].from_gguf(raw, 8, 200)


# ------------------------------------------------------------------------------------------ files
def _write_gguf(path, tensors, arch="llama"):
    """A minimal GGUF: llama metadata for a 1-layer, 256-wide model and the given raw tensors."""
    import gguf
    w = gguf.GGUFWriter(str(path), arch)
    for key, val in (("embedding_length", 256), ("block_count", 1), ("feed_forward_length", 512),
                     ("attention.head_count", 4), ("context_length", 128), ("vocab_size", 256)):
        getattr(w, "add_uint32")(f"{arch}.{key}", val)
    for name, data, qtype in tensors:
        w.add_tensor(name, data, raw_shape=data.shape, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_truncated_kquant_file_is_one_clear_line(tmp_path):
    import gguf

    from tokenfab.model.loader import ModelLoadError, load_model_files
    path = tmp_path / "k.gguf"
    _write_gguf(path, [("blk.0.ffn_down.weight", random_blocks("Q4_K", 256, 512), gguf.GGMLQuantizationType.Q4_K)])
    data = path.read_bytes()
    path.write_bytes(data[:-5000])
    with pytest.raises(ModelLoadError) as e:
        load_model_files(str(path))
    msg = str(e.value)
    assert "\n" not in msg and str(path) in msg and "truncated or corrupt" in msg


def test_unknown_quantization_type_names_it_and_lists_the_supported(tmp_path):
    import gguf

    from tokenfab.model.loader import ModelLoadError, load_model_files
    path = tmp_path / "iq.gguf"
    raw = np.zeros((4, 256 // 256 * 110), np.uint8)           # IQ3_S-sized bytes (110 per 256 weights)
    _write_gguf(path, [("blk.0.ffn_down.weight", raw, gguf.GGMLQuantizationType.IQ3_S)])
    with pytest.raises(ModelLoadError) as e:
        load_model_files(str(path))
    msg = str(e.value)
    assert "\n" not in msg and "IQ3_S" in msg and "supported: " in msg and "Q4_K" in msg and "Q6_K" in msg


def test_unknown_architecture_names_it_and_lists_the_supported(tmp_path):
    from tokenfab.model.loader import ModelLoadError, load_model_files
    path = tmp_path / "arch.gguf"
    _write_gguf(path, [], arch="mamba")
    with pytest.raises(ModelLoadError) as e:
        load_model_files(str(path))
    msg = str(e.value)
    assert "\n" not in msg and "'mamba'" in msg and "supported: " in msg and "llama" in msg


# ----------------------------------------------------------------------------------------- engine
@pytest.fixture(scope="module")
def kquant_files(tmp_path_factory, bundled_tokenizer):
    """A tiny random Llama 256 wide (K-quants need widths divisible by 256), its decoder linears written
    as Q4_K blocks with v and down in Q6_K (as llama.cpp's Q4_K_M does); the float weights are those
    blocks dequantized, so quantization="none" is the exact reference for quantization="gguf"."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from tokenfab.model.loader import load_model_files
    folder = str(tmp_path_factory.mktemp("kq"))
    cfg = AutoConfig.for_model("llama", vocab_size=len(bundled_tokenizer), hidden_size=256, intermediate_size=512,
                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                               max_position_embeddings=1024, initializer_range=0.2,
                               bos_token_id=bundled_tokenizer.bos_token_id, eos_token_id=bundled_tokenizer.eos_token_id)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(folder)
    bundled_tokenizer.save_pretrained(folder)
    loaded = load_model_files(folder)
    for name, w in list(loaded.weights.items()):
        if not name.startswith("model.layers.") or w.dim() != 2:
            continue
        kind = "Q6_K" if (".v_proj." in name or ".down_proj." in name) else "Q4_K"
        blocks = (quantize_q6_k if kind == "Q6_K" else quantize_q4_k)(w.numpy())
        loaded.gguf_raw[name] = (kind, blocks)
        loaded.weights[name] = torch.from_numpy(reference_dequantize(blocks, kind, *w.shape))
    return loaded


PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far away,"]


def _greedy(llm, prompts, n=16):
    from tokenfab import SamplingParams
    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    out = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert llm.engine.block_manager.num_used_blocks() == 0
    return out


@needs_c
def test_engine_on_kquant_layers_gives_the_float_greedy_tokens_batched_and_alone(kquant_files):
    from tokenfab import LLM
    from tokenfab.quant.load import ConcatLinear
    ref = _greedy(LLM(loaded=kquant_files, quantization="none", max_model_len=256, num_kv_blocks=64), PROMPTS)
    llm = LLM(loaded=kquant_files, quantization="gguf", max_model_len=256, num_kv_blocks=64, kernel_autotune=False)
    model = llm.engine.model
    kinds = {type(m).__name__ for m in model.modules()}
    # q/k Q4_K (as stored or as int4 blocks, as blocks_as_stored says for this CPU) + v Q6_K: a mixed qkv
    from tokenfab.quant.kquants import blocks_as_stored
    assert {"Q4_KLinear" if blocks_as_stored("cpu") else "Int4BlockLinear", "Q6_KLinear", "ConcatLinear"} <= kinds
    qkv = model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, ConcatLinear) and len(qkv.parts) == 2         # q and k concatenate into one part
    assert type(model.layers[0].mlp.down_proj).__name__ == "Q6_KLinear"
    assert _greedy(llm, PROMPTS) == ref
    assert model.attention_backend.stack_rows > 0          # the one-call stack runs the two-part qkv
    assert [_greedy(llm, [p])[0] for p in PROMPTS] == ref


@needs_c
@pytest.mark.parametrize("kind", ["Q4_K", "Q4_0"])
def test_uniform_kquant_layers_take_the_one_call_decode_stack(kquant_files, kind):
    """Every projection one block type (K-quant, or Q4_0 as stored where `blocks_as_stored` says): tf_qgemm's
    layer table takes them and the stack runs."""
    import dataclasses

    import gguf

    from tokenfab import LLM
    from tokenfab.quant.kquants import blocks_as_stored

    def quantize(w):
        if kind == "Q4_K":
            return quantize_q4_k(w)
        return gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q4_0)

    def dequantize(b, shape):
        if kind == "Q4_K":
            return reference_dequantize(b, "Q4_K", *shape)
        return gguf.quants.dequantize(b, gguf.GGMLQuantizationType.Q4_0).reshape(shape)

    raw = {k: (kind, quantize(kquant_files.weights[k].numpy())) for k in kquant_files.gguf_raw}
    weights = {**kquant_files.weights, **{k: torch.from_numpy(dequantize(b, kquant_files.weights[k].shape))
                                          for k, (_, b) in raw.items()}}
    loaded = dataclasses.replace(kquant_files, weights=weights, gguf_raw=raw)
    ref = _greedy(LLM(loaded=loaded, quantization="none", max_model_len=256, num_kv_blocks=64,
                      attention_backend="cpu"), PROMPTS)
    # the default rules, not this CPU's measured table: the stack's kernels must be what the plan picks
    llm = LLM(loaded=loaded, quantization="gguf", max_model_len=256, num_kv_blocks=64,
              attention_backend="cpu", kernel_autotune=False)
    assert _greedy(llm, PROMPTS) == ref
    assert llm.engine.model.attention_backend.stack_rows > 0
    if kind == "Q4_0":
        down = type(llm.engine.model.layers[0].mlp.down_proj).__name__
        assert down == ("Q4_0BlocksLinear" if blocks_as_stored("cpu") else "Q4_0Linear")


# ------------------------------------------------------------------------------------ quant schemes
def test_q4_k_and_q6_k_candidates_quantize_every_256_wide_linear_with_their_kl(kquant_files):
    """`tokenfab quant eval --candidate q4_k|q6_k`: K-quant layers for every decoder linear (all 256 or
    512 wide here), KL against the float model measured: Q6_K's below Q4_K's, and Q4_K's (4.5 bits, 6-bit
    sub-scales) near plain int4-g32's (fp32 scale and zero per 32: 6 bits per weight). This random
    model's logits are very peaked, so KL grows less than the squared weight error."""
    from tokenfab.quant.compare import evaluate
    kl = {s: evaluate(None, s, ctx=64, max_windows=2, base_files=kquant_files).report.kl_mean
          for s in ("q4_k", "q6_k", "int4-g32")}
    assert 0 < kl["q6_k"] < 0.75 * kl["q4_k"]
    assert kl["q4_k"] < 2 * kl["int4-g32"], kl


def test_q4_k_falls_back_to_int4_where_the_width_is_not_a_multiple_of_256():
    from tokenfab.quant.apply import quantize_linear
    assert type(quantize_linear(torch.nn.Linear(512, 64), "q4_k")).__name__ == "Q4_KLinear"
    assert type(quantize_linear(torch.nn.Linear(576, 64), "q4_k")).__name__ == "Int4Linear"
    assert type(quantize_linear(torch.nn.Linear(576, 64), "q6_k")).__name__ == "Int8Linear"


@pytest.mark.parametrize("kind,bpw", [("Q4_K", "4.500"), ("Q6_K", "6.562")])
def test_plan_reads_kquant_files_with_their_true_bits_per_weight(tmp_path, kind, bpw):
    import gguf

    from tokenfab.plan.models import from_gguf
    path = tmp_path / f"{kind}.gguf"
    _write_gguf(path, [("blk.0.ffn_down.weight", random_blocks(kind, 256, 512), gguf.GGMLQuantizationType[kind])])
    assert from_gguf(str(path)).default_dtype == f"bpw:{bpw}"


@needs_c
def test_q4_k_checkpoint_folder_loads_back_and_generates_as_quantizing_at_load(kquant_files, tmp_path):
    """`tokenfab quant --scheme q4_k --out DIR` then LLM(model=DIR): the same greedy tokens as
    quantization="q4_k" applied at load to the same float weights."""
    from tokenfab import LLM
    from tokenfab.quant.export import quantize_to_folder
    from tokenfab.model.loader import load_model_files
    out = str(tmp_path / "q4k")
    quantize_to_folder(kquant_files.path, "q4_k", out)
    saved = LLM(model=out, max_model_len=256, num_kv_blocks=64, kernel_autotune=False)
    assert sum(type(m).__name__ == "Q4_KLinear" for m in saved.engine.model.modules()) == 2 * 4
    at_load = LLM(loaded=load_model_files(kquant_files.path), quantization="q4_k", max_model_len=256,
                  num_kv_blocks=64, kernel_autotune=False)
    assert _greedy(saved, PROMPTS) == _greedy(at_load, PROMPTS)

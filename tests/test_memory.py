"""Where the engine's memory goes: KV pool sizing, the float-copy budget, the quantized tied embedding,
lazily resident KV pages, and that the process's RSS does not grow across loads. RSS against llama.cpp's
is a benchmark (benchmarks/serve_memory.py), not a test: it depends on the CPU and its libraries."""
import json
import subprocess
import sys

import pytest
import torch

from tokenfab.config import EngineConfig
from tokenfab.worker.kv_sizing import kv_pool_blocks
from tokenfab.worker.memory import float_copy_budget, process_rss, release_freed_memory
from tokenfab.worker.model_runner import reserve_zeros

GIB = 1 << 30


def test_kv_pool_is_sized_from_max_num_seqs_times_max_model_len_when_that_is_smaller():
    cfg = EngineConfig(max_num_seqs=8, max_model_len=8192, block_size=16)
    blocks, why = kv_pool_blocks(cfg, 8192, block_bytes=1024)
    assert blocks == 8 * 8192 // 16 and "max_num_seqs 8" in why


def test_kv_pool_share_and_cap_come_from_engine_config():
    need = EngineConfig(max_num_seqs=64, max_model_len=1 << 20)
    blocks, why = kv_pool_blocks(EngineConfig(max_num_seqs=64, max_model_len=1 << 20, kv_cache_memory_max=1 << 20),
                                 1 << 20, block_bytes=1024)
    assert blocks == 1024 and "kv_cache_memory_max" in why          # the cap, in bytes / block bytes
    tiny = EngineConfig(max_num_seqs=64, kv_cache_memory_fraction=0.0)
    assert kv_pool_blocks(tiny, 1 << 20, block_bytes=1024)[0] == 0   # the engine then refuses: too small
    assert kv_pool_blocks(need, 1 << 20, 1024)[0] > 0


def test_float_copies_are_off_while_decode_steps_fit_the_c_kernel_and_on_beyond():
    avail = 16 * GIB
    assert float_copy_budget(EngineConfig(max_num_seqs=8), avail, 0)[0] == 0
    assert float_copy_budget(EngineConfig(max_num_seqs=16), avail, 0)[0] == 0
    on, why = float_copy_budget(EngineConfig(max_num_seqs=64), avail, 0)
    assert on == int(avail * 0.25) and "auto" in why
    # speculation: 4 sequences x (1 + 4 drafts) = 20 rows per decode step
    assert float_copy_budget(EngineConfig(max_num_seqs=4), avail, 0, num_speculative_tokens=4)[0] > 0
    # the KV pool beyond its own fraction comes out of the copies' share
    assert float_copy_budget(EngineConfig(max_num_seqs=64), avail, int(avail * 0.4))[0] == int(avail * 0.05)


def test_float_copy_budget_obeys_explicit_bytes_and_the_off_switch():
    assert float_copy_budget(EngineConfig(max_num_seqs=8, float_cache_memory=GIB), 16 * GIB, 0) == (GIB, "float_cache_memory")
    assert float_copy_budget(EngineConfig(max_num_seqs=64, enable_float_cache=False), 16 * GIB, 0)[0] == 0
    assert float_copy_budget(EngineConfig(max_num_seqs=64, float_cache_memory=0), 16 * GIB, 0)[0] == 0


@pytest.mark.parametrize("bad", [dict(kv_cache_memory_fraction=1.5), dict(float_cache_memory_fraction=-0.1),
                                 dict(float_cache_memory=-1), dict(kv_cache_memory_max=0)])
def test_memory_knobs_out_of_range_are_refused_with_their_name(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        EngineConfig(**bad).validate()


def test_kv_pool_pages_become_resident_only_where_written_in_small_pages():
    release_freed_memory()
    before = process_rss()
    if before is None:
        pytest.skip("no /proc/self/status: RSS cannot be read on this OS")
    pool = reserve_zeros((60, 1 << 20), torch.float32, "cpu")        # 240 MiB reserved, like 60 K/V slabs
    assert process_rss() - before < 8 << 20
    pool[:, 0] = 1.0                                                  # one element per slab
    # 4 KiB pages: ~240 KiB; transparent huge pages would have made 60 x 2 MiB resident
    assert process_rss() - before < 16 << 20
    assert float(pool[:, 1].abs().sum()) == 0.0 and float(pool[:, 0].sum()) == 60.0


def test_a_tied_quantized_head_serves_the_embedding_rows_without_a_float_copy(bundled_files):
    from tokenfab import LLM
    from tokenfab.model.layers import HeadRowsEmbedding
    llm = LLM(loaded=bundled_files, num_kv_blocks=64, max_model_len=256, adaptive_threads=False)  # auto: GGUF blocks
    m = llm.engine.model
    assert isinstance(m.embed_tokens, HeadRowsEmbedding) and m.embed_tokens.weight.numel() == 0
    ids = torch.tensor([0, 1, 17, 4095, m.config.vocab_size - 1])
    # the file's Q8_0 rows, dequantized at lookup: exactly what the loader's float copy held
    assert torch.equal(m.embed_tokens(ids), bundled_files.weights["model.embed_tokens.weight"][ids])
    # No module keeps the [vocab, hidden] rows as floats: the head's quantized blocks serve both. (Whether
    # the kernel table also keeps a float copy for the head's GEMM is the CPU's measured choice, and
    # lives in the head's plan, not in the model's tensors.)
    rows = m.config.vocab_size * m.config.hidden_size
    assert [n for n, t in list(m.named_parameters()) + list(m.named_buffers())
            if t.is_floating_point() and t.numel() == rows] == []
    from tokenfab.sampling import SamplingParams
    out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
    assert llm.engine.block_manager.num_used_blocks() == 0


def test_info_engine_says_where_memory_goes():
    """`tokenfab info --engine` at 8 slots and an 8k context: no float copies (decode steps fit the C
    kernel), the KV pool reserved within what the configuration needs, and the RSS it reports. How that
    RSS compares with llama.cpp's depends on the CPU and its libraries: benchmarks/serve_memory.py
    measures it."""
    r = subprocess.run([sys.executable, "-m", "tokenfab", "info", "--engine", "--json", "--max-num-seqs", "8",
                        "--max-model-len", "8192"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    info = json.loads(r.stdout)
    mem = info["memory_mib"]
    assert mem["float copies"] == 0 and "auto" in info["float_copies"]
    # 8 x 8192 tokens x 46,080 bytes, or less where 20 % of this machine's available memory is less
    assert 0 < mem["KV pool (reserved)"] <= 65536 * 46080 / 2**20 + 0.1
    if "process RSS after load" in mem:                # Linux with glibc
        assert 0 < mem["process RSS after load"] <= mem["process RSS peak during load"]


def test_rss_does_not_grow_across_repeated_loads(bundled_files):
    """Loading the same model again, after the first engine is gone, takes back no more memory than the
    first load kept: nothing (weights, float copies, plans, KV pool) outlives its engine."""
    import gc

    from tokenfab import LLM
    if process_rss() is None:
        pytest.skip("no /proc/self/status: RSS cannot be read on this OS")

    def load_and_drop() -> int:
        llm = LLM(loaded=bundled_files, num_kv_blocks=64, max_model_len=256, adaptive_threads=False)
        del llm
        gc.collect()
        release_freed_memory()
        return process_rss()

    load_and_drop()                                   # the first load also maps libraries and fills caches
    after = [load_and_drop() for _ in range(3)]
    # One load's weights and plans are ~150 MiB: a leak of one engine per load would add that each time.
    assert after[-1] - after[0] < 32 << 20, [a >> 20 for a in after]


def test_memory_flags_map_onto_engine_config_fields():
    import argparse

    from tokenfab.engine_args import add_engine_args, engine_config_from_args
    p = argparse.ArgumentParser()
    add_engine_args(p)
    cfg = engine_config_from_args(p.parse_args(["--float-cache-memory", "0", "--kv-cache-memory-fraction", "0.1",
                                                "--kv-cache-memory-max", "1GiB", "--float-cache-memory-fraction", "0.5"]))
    assert (cfg.float_cache_memory, cfg.kv_cache_memory_fraction, cfg.kv_cache_memory_max,
            cfg.float_cache_memory_fraction) == (0, 0.1, 1 << 30, 0.5)
    assert engine_config_from_args(p.parse_args(["--float-cache-memory", "1GiB"])).float_cache_memory == 1 << 30


def test_a_gguf_build_never_reads_float_copies_of_the_layers_it_runs_from_blocks(bundled_path):
    """The loader reads GGUF tensors lazily, and the native layers go in before the float weights: the
    bundled model's build dequantizes its norms and nothing else (its load peaked at 1.4 GiB when every
    tensor became float32 up front)."""
    from tokenfab.model.loader import load_model_files
    from tokenfab.quant.load import build_model
    files = load_model_files(bundled_path)
    assert files.weights.reads == 0
    model = build_model(files, torch.bfloat16, "cpu", 16, 64)
    assert files.weights.reads == 2 * files.config.num_layers + 1        # two norms a layer, the final norm
    assert not any(p.is_meta for p in model.parameters()) and not any(b.is_meta for b in model.buffers())
    assert "model.embed_tokens.weight" in files.weights and files.weights.reads == 61   # `in` reads nothing


def test_native_layers_put_in_before_the_float_weights_equal_those_swapped_in_after(tmp_path, bundled_tokenizer):
    """Qwen2's q/k/v biases come from the file when the layers are built on the meta device."""
    import gguf

    from tests.oracle import make_tiny_model
    from tokenfab.model.llama import LlamaModel, full_logits
    from tokenfab.model.loader import load_model_files
    from tokenfab.quant.load import build_model, use_gguf_blocks
    from tokenfab.quant.linear import Q8_0Linear
    make_tiny_model("qwen2", str(tmp_path), bundled_tokenizer)
    files = load_model_files(str(tmp_path))
    q8 = gguf.GGMLQuantizationType.Q8_0
    for name, w in list(files.weights.items()):
        if w.dim() == 2:
            blocks = gguf.quants.quantize(w.numpy(), q8)
            files.gguf_raw[name] = ("Q8_0", blocks)
            files.weights[name] = torch.from_numpy(gguf.quants.dequantize(blocks, q8).copy())
        else:     # bf16-exact, so that a bias cast to the compute dtype first (the old order) equals it
            files.weights[name] = w.bfloat16().float()
    new = build_model(files, torch.bfloat16, "cpu", 16, 64)
    with torch.device("meta"):
        old = LlamaModel(files.config, 16, max_positions=1)
    old.make_ropes(64)
    old.load_hf_weights(files.weights, torch.bfloat16)
    use_gguf_blocks(old, files.gguf_raw)             # the old order: float layers first, then swapped
    old.set_attention_backend(old.default_backend())
    qkv = new.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, Q8_0Linear) and qkv.bias is not None and float(qkv.bias.abs().sum()) > 0
    ids = bundled_tokenizer.encode("The capital of France is")
    assert torch.equal(full_logits(new, ids), full_logits(old, ids))


def test_a_model_larger_than_free_memory_is_refused_before_loading_with_the_numbers(bundled_files, monkeypatch):
    """The weights' bytes (a GGUF file run on its blocks: its size; else every parameter in the dtype) against
    the device's free memory, before any weight is read."""
    import os

    from tokenfab import LLM
    from tokenfab.model.loader import ModelLoadError
    from tokenfab.worker import memory
    size = os.path.getsize(bundled_files.path)
    assert memory.weights_bytes_needed(bundled_files, torch.float32, "auto") == size
    assert memory.weights_bytes_needed(bundled_files, torch.float32, "none") == bundled_files.config.num_params() * 4
    monkeypatch.setattr(memory, "available_memory", lambda device: size - 1)
    with pytest.raises(ModelLoadError, match=r"weights need about 0\.\d GiB .* and cpu has 0\.\d GiB free: use a "
                                             r"smaller model or a smaller quantization") as e:
        LLM(loaded=bundled_files, max_model_len=256, num_kv_blocks=16)
    assert "\n" not in str(e.value)
    monkeypatch.setattr(memory, "available_memory", lambda device: size + (1 << 20))
    with pytest.raises(ModelLoadError, match="weights need"):      # dequantized to float32: four bytes each
        LLM(loaded=bundled_files, max_model_len=256, num_kv_blocks=16, quantization="none")

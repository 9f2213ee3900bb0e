"""kv_cache_dtype="float16": half-size KV pools that the cpu backend's C kernels read (decode attention
is bandwidth-bound at many streams), end to end on the bundled model against float32 pools."""
import pytest
import torch

from tokenfab import kernels
from tokenfab.config import EngineConfig


def test_an_unknown_kv_cache_dtype_names_the_choices():
    with pytest.raises(ValueError, match="kv_cache_dtype must be auto, float32, float16 or int8"):
        EngineConfig(kv_cache_dtype="fp8").validate()


def test_auto_takes_float16_pools_only_where_the_c_kernels_read_them():
    from tokenfab.model.attention import kv_cache_torch_dtype
    from tokenfab.model.backends import c_float16_pools
    assert kv_cache_torch_dtype("auto", torch.float32, c_float16=True) == torch.float16
    assert kv_cache_torch_dtype("auto", torch.float32, c_float16=False) == torch.float32
    assert kv_cache_torch_dtype("auto", torch.bfloat16, c_float16=True) == torch.bfloat16
    assert kv_cache_torch_dtype("float32", torch.float32, c_float16=True) == torch.float32
    assert kv_cache_torch_dtype("float16", torch.float32) == torch.float16
    assert c_float16_pools("cpu", "cpu", 64) == (kernels.f16_pools(64) is None)
    for args in (("torch", "cpu", 64), ("auto", "cpu", 32), ("auto", "cuda", 64), ("auto", "cpu", 64, 2)):
        assert not c_float16_pools(*args), args


@pytest.mark.skipif(kernels.f16_pools(64) is not None, reason=f"{kernels.f16_pools(64)}")
def test_float16_pools_run_on_the_c_kernels_and_stay_close_to_float32_pools(bundled_files):
    # "auto" is float16 here (the bundled model's head_dim is 64): float32 is asked for by name
    from tokenfab import LLM, SamplingParams
    prompt = list(range(2000, 2150))        # 150 tokens in chunks of 64: later chunks read the pool
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=0, prompt_logprobs=0)
    runs = {}
    for kv in ("auto", "float32"):
        llm = LLM(loaded=bundled_files, max_model_len=512, num_kv_blocks=64, kernel_autotune=False,
                  max_num_batched_tokens=64, kv_cache_dtype=kv, quantization="none")
        backend = llm.engine.model.attention_backend
        assert backend.name == "cpu" and backend.c_attention
        assert llm.engine.runner.kv.dtype == (torch.float16 if kv == "auto" else torch.float32)
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        c = out.outputs[0]
        runs[kv] = (torch.tensor([next(iter(lp.values())).logprob for lp in out.prompt_logprobs[1:]]),
                    c.token_ids, [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)])
        assert llm.engine.block_manager.num_used_blocks() == 0
    (p16, t16, l16), (p32, t32, l32) = runs["auto"], runs["float32"]
    assert (p16 - p32).abs().max() < 0.05
    assert t16[0] == t32[0]
    same = next((i for i, (a, b) in enumerate(zip(t16, t32)) if a != b), len(t16))
    assert max(abs(a - b) for a, b in zip(l16[:same], l32[:same])) < 0.05


def test_metrics_config_info_says_what_auto_became():
    # `tokenfab doctor` sizes KV from this label: "auto" alone would not say float16 or float32
    from types import SimpleNamespace
    from tokenfab.engine.async_engine import model_info
    for pools, label in ((torch.zeros(1, dtype=torch.float16), "float16"), (torch.zeros(1), "float32")):
        engine = SimpleNamespace(config=EngineConfig(), runner=SimpleNamespace(kv=pools), max_model_len=64,
                                 model_config=SimpleNamespace(vocab_size=100))
        assert model_info(engine).config_labels["kv_cache_dtype"] == label
    engine.config = EngineConfig(kv_cache_dtype="int8")
    assert model_info(engine).config_labels["kv_cache_dtype"] == "int8"

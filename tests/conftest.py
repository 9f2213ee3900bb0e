"""Shared fixtures: the bundled model's path and tokenizer, loaded once per pytest session."""
import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def bundled_path() -> str:
    from tokenfab.files.bundled import bundled_model_path
    return bundled_model_path()


@pytest.fixture(scope="session")
def bundled_tokenizer(bundled_path):
    from tokenfab.files.tokenizer import load_tokenizer
    return load_tokenizer(bundled_path)


@pytest.fixture(scope="session")
def bundled_files(bundled_path):
    """The bundled model's config, weights and tokenizer, read once; pass as LLM(loaded=...)."""
    from tokenfab.model.loader import load_model_files
    return load_model_files(bundled_path)


@pytest.fixture(scope="session")
def bundled_llm(bundled_files):
    """The bundled model, float32 weights and KV pools (token-exact with transformers), shared by tests that only generate (each must leave no request behind)."""
    from tokenfab import LLM
    llm = LLM(max_model_len=2048, num_kv_blocks=1024, quantization="none", kv_cache_dtype="float32", loaded=bundled_files)
    yield llm
    assert llm.engine.block_manager.num_used_blocks() == 0


@pytest.fixture(scope="module")
def one_thread():
    """torch on 1 thread for a module, restored afterwards. On a shared 2-core machine, 2 threads made the
    quant engine tests wait on each other's parallel regions and run 3-7x slower (measured)."""
    import torch
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def isa(request):
    """The C library's build for one instruction set, loaded for the test and unloaded after it; a skip
    naming what this CPU runs where it lacks the set. Parametrize indirectly:
    `@pytest.mark.parametrize("isa", ["avx2", "avx512"], indirect=True)`. None: whatever the process runs."""
    from tokenfab import kernels
    name = request.param
    if name is None:
        yield None
        return
    if name not in kernels.available_isas():
        pytest.skip(f"this CPU lacks the {name} instruction set (it runs {', '.join(kernels.available_isas())})")
    kernels.set_isa(name)
    if not kernels.enabled() or kernels.isa() != name:
        kernels.set_isa(None)
        pytest.skip(f"the CPU has the {name} instruction set, but building tokenfab's kernels for it failed here "
                    "(an older compiler?)")
    try:
        yield name
    finally:
        kernels.set_isa(None)


@pytest.fixture
def vloop():
    """The bench's virtual-clock event loop (tokenfab/bench/fake_server.py), closed after the test."""
    from tokenfab.bench.fake_server import VirtualClockLoop
    loop = VirtualClockLoop()
    yield loop
    loop.run_until_complete(loop.shutdown_asyncgens())
    loop.close()

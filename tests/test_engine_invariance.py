"""Greedy output is the same token sequence whatever the batch, chunking, preemption or prefix-cache hits.

Reference: each prompt run alone. Every scenario also checks that no KV block is held afterwards.
"""
import random

import pytest

from tokenfab import LLM, SamplingParams
from tests.oracle import record_steps

NEW = 8   # enough to see a divergence; each of the 32 reference prompts runs alone, so it sets the file's time
GREEDY = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True)
WORDS = ("the quick brown fox jumps over a lazy dog while seven clever engineers write fast kernels "
         "for memory bound decoding on small machines under real load").split()


def make_prompts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 120))) for _ in range(n)]


PROMPTS = make_prompts(32)


@pytest.fixture(scope="module")
def reference(bundled_llm):
    """One prompt at a time."""
    return [bundled_llm.generate(p, GREEDY)[0].outputs[0].token_ids for p in PROMPTS]


def run(llm: LLM, prompts=PROMPTS, params=GREEDY) -> list[list[int]]:
    outs = llm.generate(prompts, params)
    assert llm.engine.block_manager.num_used_blocks() == 0, "blocks leaked"
    assert not llm.engine.has_unfinished_requests()
    return [o.outputs[0].token_ids for o in outs]


def test_32_mixed_prompts_batched_match_one_at_a_time(bundled_llm, reference):
    assert run(bundled_llm) == reference


def test_tiny_token_budget_forces_chunked_prefill_and_matches(bundled_files, reference):
    llm = LLM(loaded=bundled_files, quantization="none", max_model_len=1024, num_kv_blocks=1024, max_num_batched_tokens=24)
    steps = record_steps(llm)
    assert run(llm) == reference
    # Some step mixed a prefill chunk with decodes, and no step went over the budget.
    assert any(1 in b.num_new_tokens and any(n > 1 for n in b.num_new_tokens) for b in steps)
    assert all(b.total_tokens <= 24 for b in steps)


def test_tiny_kv_pool_forces_preemption_and_matches(bundled_files, reference):
    # 24 blocks of 16 tokens: room for about three sequences at a time, so most get preempted.
    llm = LLM(loaded=bundled_files, quantization="none", max_model_len=384, num_kv_blocks=24, block_size=16)
    assert run(llm) == reference
    assert llm.engine.scheduler.num_preemptions > 0


def test_prefix_cache_hits_on_shared_system_prompt_and_match_uncached(bundled_files):
    system = " ".join(make_prompts(1, seed=7)[0].split()[:100]) * 3   # a long shared prefix
    prompts = [system + " question " + q for q in make_prompts(8, seed=3)]
    uncached = LLM(loaded=bundled_files, quantization="none", max_model_len=2048, num_kv_blocks=512, enable_prefix_caching=False)
    expected = run(uncached, prompts)
    assert uncached.engine.stats().prefix_cache_hits == 0

    cached = LLM(loaded=bundled_files, quantization="none", max_model_len=2048, num_kv_blocks=512)
    first = run(cached, prompts[:1])                # fills the cache with the shared prefix
    assert cached.engine.stats().prefix_cache_hits == 0
    rest = run(cached, prompts[1:])
    stats = cached.engine.stats()
    prefix_len = len(cached.engine.tokenize(system))
    assert stats.prefix_cache_hits >= 7 * (prefix_len // 16 - 1) * 16
    assert first + rest == expected


def test_abort_mid_run_frees_every_block(bundled_llm):
    eng = bundled_llm.engine
    for i, p in enumerate(PROMPTS[:6]):
        eng.add_request(f"abort-{i}", p, SamplingParams(max_tokens=50, temperature=0))
    for _ in range(3):
        eng.step()
    assert eng.block_manager.num_used_blocks() > 0
    for i in range(6):
        eng.abort_request(f"abort-{i}")
    assert eng.block_manager.num_used_blocks() == 0
    assert not eng.has_unfinished_requests()
    assert eng.step() == []

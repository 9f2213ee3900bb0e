"""Speculative decoding with a draft model (`method: "draft"`): greedy output token for token the same
as plain decoding (batched, chunked prefills, preemption, prefix-cache hits), no block held after
aborts, and a draft with another vocabulary refused by name. Tiny random-weight Llamas sharing the
bundled tokenizer: the target drafting for itself (acceptance near 1) and a smaller random draft
(acceptance near 0: every round rejects), so both the accept and the rollback paths run."""
import random

import pytest

from tokenfab import LLM, SamplingParams
from tests.oracle import record_steps

pytestmark = pytest.mark.timeout(900)
GREEDY = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
WORDS = "the quick brown fox jumps over a lazy dog while seven clever engineers write fast kernels".split()


def make_prompts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 90))) for _ in range(n)]


PROMPTS = make_prompts(6)


@pytest.fixture(scope="module")
def target(tmp_path_factory, bundled_tokenizer):
    from oracle import make_tiny_model
    folder = str(tmp_path_factory.mktemp("draft-target"))
    make_tiny_model("llama", folder, bundled_tokenizer, seed=5)
    return folder


@pytest.fixture(scope="module")
def small_draft(tmp_path_factory, bundled_tokenizer):
    """A smaller Llama (1 layer, narrower) with the same tokenizer and vocabulary, other weights."""
    from transformers import AutoConfig, AutoModelForCausalLM
    import torch
    folder = str(tmp_path_factory.mktemp("draft-small"))
    cfg = AutoConfig.for_model("llama", vocab_size=len(bundled_tokenizer), max_position_embeddings=1024,
                               hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                               num_key_value_heads=1, initializer_range=0.2, tie_word_embeddings=True,
                               bos_token_id=bundled_tokenizer.bos_token_id, eos_token_id=bundled_tokenizer.eos_token_id)
    torch.manual_seed(9)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(folder)
    bundled_tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def reference(target):
    llm = LLM(target, max_model_len=256, num_kv_blocks=256)
    return tokens(run(llm))


def run(llm: LLM, prompts=PROMPTS, params=GREEDY):
    outs = llm.generate(prompts, params)
    assert llm.engine.block_manager.num_used_blocks() == 0, "blocks leaked"
    assert not llm.engine.has_unfinished_requests()
    return outs


def tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def draft_llm(target: str, draft: str, **kw) -> LLM:
    kw.setdefault("max_model_len", 256)
    kw.setdefault("num_kv_blocks", 256)
    spec = {"method": "draft", "model": draft, "num_speculative_tokens": 4, "max_batch_size": 64, "adaptive": False}
    return LLM(target, speculative_config=spec, **kw)


@pytest.fixture(params=["self", "small"])
def draft(request, target, small_draft):
    return target if request.param == "self" else small_draft


def assert_drafted(llm: LLM, accepted: bool) -> None:
    st = llm.engine.stats()
    assert st.spec_decode_num_drafts > 0, st
    if accepted:
        assert st.spec_decode_num_accepted_tokens > 0.8 * st.spec_decode_num_draft_tokens, st


def test_greedy_batched_matches_plain_token_for_token(target, draft, reference):
    llm = draft_llm(target, draft)
    assert tokens(run(llm)) == reference
    assert_drafted(llm, accepted=draft == target)


@pytest.mark.slow
def test_greedy_with_chunked_prefills_matches(target, draft, reference):
    llm = draft_llm(target, draft, max_num_batched_tokens=24)
    steps = record_steps(llm)
    assert tokens(run(llm)) == reference
    assert max(len(llm.engine.tokenize(p)) for p in PROMPTS) > 24      # so some prompt ran in chunks
    assert all(b.total_tokens <= 24 for b in steps)
    assert_drafted(llm, accepted=draft == target)


@pytest.mark.slow
def test_greedy_with_preemption_matches(target, draft, reference):
    llm = draft_llm(target, draft, max_model_len=160, num_kv_blocks=14)
    assert tokens(run(llm)) == reference
    assert llm.engine.scheduler.num_preemptions > 0
    assert_drafted(llm, accepted=draft == target)


@pytest.mark.slow
def test_greedy_with_prefix_cache_hits_matches(target, draft):
    system = " ".join(WORDS * 3)
    prompts = [f"{system} {p}" for p in PROMPTS[:4]]
    expected = tokens(run(LLM(target, max_model_len=256, num_kv_blocks=256, enable_prefix_caching=False), prompts))
    llm = draft_llm(target, draft)
    got = tokens(run(llm, prompts[:1])) + tokens(run(llm, prompts[1:]))
    assert llm.engine.stats().prefix_cache_hits > 0
    assert got == expected
    assert tokens(run(llm, prompts)) == expected
    assert_drafted(llm, accepted=draft == target)


def test_abort_in_the_middle_of_verification_frees_every_block(target):
    eng = draft_llm(target, target).engine
    for i in range(3):
        eng.add_request(f"a{i}", PROMPTS[i], SamplingParams(max_tokens=60, temperature=0, ignore_eos=True))
    while eng.stats().spec_decode_num_drafts == 0:
        eng.step()
    # Drafts proposed for the next step (blocks allocated for them), then aborted before it runs.
    eng.spec.propose(eng.scheduler.running)
    assert any(s.spec_tokens for s in eng.scheduler.running)
    for i in range(3):
        eng.abort_request(f"a{i}")
    assert eng.block_manager.num_used_blocks() == 0
    assert eng.step() == []


def test_sampled_output_is_reproducible_with_a_seed(target, small_draft):
    params = SamplingParams(max_tokens=24, temperature=1.0, top_p=0.9, seed=7, ignore_eos=True)
    a = tokens(run(draft_llm(target, small_draft), PROMPTS[:2], params))
    b = tokens(run(draft_llm(target, small_draft), PROMPTS[:2], params))
    assert a == b and all(len(t) == 24 for t in a)


def test_draft_with_another_vocabulary_is_a_clear_error(target, tmp_path, bundled_tokenizer):
    from transformers import AutoConfig, AutoModelForCausalLM
    cfg = AutoConfig.for_model("llama", vocab_size=len(bundled_tokenizer) + 64, hidden_size=32, intermediate_size=64,
                               num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path)
    bundled_tokenizer.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"vocabulary of \d+ tokens but the target has \d+: a draft model must "
                                         r"use the target's tokenizer"):
        draft_llm(target, str(tmp_path))


def test_draft_config_needs_a_model_path(target):
    with pytest.raises(ValueError, match="method 'draft' needs \"model\""):
        LLM(target, speculative_config={"method": "draft", "num_speculative_tokens": 3})

"""Speculative decoding inside the engine: greedy output token for token the same as plain decoding
(batched, chunked, preempted, prefix-cached), the sampled distribution exactly the target's, stops
and limits exact when several tokens land at once, and no KV block held afterwards."""
import random

import pytest
import torch

from tokenfab import LLM, SamplingParams
from tests.oracle import record_steps

pytestmark = pytest.mark.timeout(1200)     # several engines on the bundled model; slow on shared cores
NEW = 32   # a few dozen speculative steps per prompt; the layerskip run sets the file's time
GREEDY = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True)
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "max_batch_size": 64}
# layerskip and the self-draft cost as much per draft as they could save: the adaptive policy would
# (rightly) never draft with them, so these equality tests force k.
LAYERSKIP = {"method": "layerskip", "num_speculative_tokens": 3, "num_layers": 20, "max_batch_size": 64,
             "adaptive": False}
# The bundled model drafting for itself: a real GGUF draft, its own KV pool, acceptance near 1.
DRAFT = {"method": "draft", "model": None, "num_speculative_tokens": 4, "max_batch_size": 64, "adaptive": False}
METHODS = pytest.mark.parametrize("method", [pytest.param(NGRAM, id="ngram"), pytest.param(LAYERSKIP, id="layerskip"),
                                             pytest.param(DRAFT, id="draft", marks=pytest.mark.slow)])
PASSAGES = [
    "The cache holds blocks of sixteen tokens each, and the scheduler admits requests while the budget allows.",
    "def add(a, b):\n    return a + b\n\ndef mul(a, b):\n    return a * b\n",
    "Seven clever engineers write fast kernels for memory bound decoding on small machines under real load.",
]
WORDS = "the quick brown fox jumps over a lazy dog while seven clever engineers write fast kernels".split()


def make_prompts(n: int, seed: int = 0) -> list[str]:
    """Mixed lengths: copy tasks (drafts accepted often) and random word soups (rarely)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        if i % 2 == 0:
            p = PASSAGES[i // 2 % len(PASSAGES)] * rng.randint(1, 3)
            out.append(f"Repeat the text.\nText: {p}\nRepeat: ")
        else:
            out.append(" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 120))))
    return out


PROMPTS = make_prompts(8)


def run(llm: LLM, prompts=PROMPTS, params=GREEDY):
    outs = llm.generate(prompts, params)
    assert llm.engine.block_manager.num_used_blocks() == 0, "blocks leaked"
    assert not llm.engine.has_unfinished_requests()
    return outs


def tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def spec_llm(files, **kw) -> LLM:
    kw.setdefault("max_model_len", 1024)
    kw.setdefault("num_kv_blocks", 1024)
    spec = kw.pop("spec", NGRAM)
    if spec["method"] == "draft" and spec["model"] is None:
        spec = {**spec, "model": files.path}
    return LLM(loaded=files, quantization="none", speculative_config=spec, **kw)


@pytest.fixture(scope="module")
def reference(bundled_llm):
    return tokens(run(bundled_llm))


def assert_speculated(llm: LLM) -> None:
    st = llm.engine.stats()
    assert st.spec_decode_num_drafts > 0 and st.spec_decode_num_accepted_tokens > 0, st


@METHODS
def test_greedy_batched_matches_plain_token_for_token(bundled_files, reference, method):
    llm = spec_llm(bundled_files, spec=method)
    assert tokens(run(llm)) == reference
    assert_speculated(llm)


@pytest.mark.slow
@METHODS
def test_greedy_under_tiny_token_budget_chunks_prefills_and_matches(bundled_files, reference, method):
    llm = spec_llm(bundled_files, max_num_batched_tokens=24, spec=method)
    steps = record_steps(llm)
    assert tokens(run(llm)) == reference
    assert_speculated(llm)
    assert all(b.total_tokens <= 24 for b in steps)
    assert any(n > 1 for b in steps for n in b.num_new_tokens if b.seqs)


@pytest.mark.slow
@METHODS
def test_greedy_with_preemption_matches(bundled_files, reference, method):
    llm = spec_llm(bundled_files, max_model_len=384, num_kv_blocks=24, spec=method)
    assert tokens(run(llm)) == reference
    assert llm.engine.scheduler.num_preemptions > 0
    assert_speculated(llm)


@pytest.mark.slow
@METHODS
def test_greedy_with_prefix_cache_hits_matches_uncached(bundled_files, method):
    system = PASSAGES[0] * 4
    prompts = [f"{system}\nRepeat the text.\nText: {p}\nRepeat: " for p in PASSAGES] + [system + " and then"]
    uncached = LLM(loaded=bundled_files, quantization="none", max_model_len=1024, num_kv_blocks=1024,
                   enable_prefix_caching=False)
    expected = tokens(run(uncached, prompts))
    cached = spec_llm(bundled_files, spec=method)
    got = tokens(run(cached, prompts[:1])) + tokens(run(cached, prompts[1:]))
    assert cached.engine.stats().prefix_cache_hits > 0
    assert got == expected
    # Speculated blocks are registered only once all their tokens are accepted: every registered
    # block's hash chain matches its tokens, so a second pass over the same prompts still matches.
    assert tokens(run(cached, prompts)) == expected
    assert_speculated(cached)


COPY = "Repeat the text.\nText: " + PASSAGES[0] + "\nRepeat: "


@pytest.fixture(scope="module")
def copy_llms(bundled_files):
    # float32 pools: the logprob test compares to 1e-3, finer than float16 keys and values hold
    return LLM(loaded=bundled_files, quantization="none", max_model_len=1024, num_kv_blocks=256, kv_cache_dtype="float32"), \
        spec_llm(bundled_files, num_kv_blocks=256, kv_cache_dtype="float32",
                 spec={**NGRAM, "num_speculative_tokens": 8, "adaptive": False})


def outputs_match(copy_llms, params):
    plain, spec = copy_llms
    a, b = run(plain, [COPY], params)[0].outputs[0], run(spec, [COPY], params)[0].outputs[0]
    assert (b.token_ids, b.text, b.finish_reason, b.stop_reason) == (a.token_ids, a.text, a.finish_reason, a.stop_reason)
    return a


def test_opt_out_per_request_never_drafts(copy_llms):
    spec = copy_llms[1]
    before = spec.engine.stats().spec_decode_num_drafts
    run(spec, [COPY, PROMPTS[1]], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, speculative=False))
    assert spec.engine.stats().spec_decode_num_drafts == before


def test_batch_switch_turns_speculation_off_above_max_batch_size(copy_llms):
    spec = copy_llms[1]
    policy = spec.engine.spec.policy
    before = spec.engine.stats().spec_decode_num_drafts
    policy.max_batch_size = 2
    try:
        run(spec, [COPY] * 3, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    finally:
        policy.max_batch_size = 64
    assert spec.engine.stats().spec_decode_num_drafts == before


def test_stop_string_inside_an_accepted_run_stops_exactly_there(copy_llms):
    before = copy_llms[1].engine.stats().spec_decode_num_accepted_tokens
    out = outputs_match(copy_llms, SamplingParams(max_tokens=40, temperature=0, stop=["sixteen"]))
    assert out.finish_reason == "stop" and out.stop_reason == "sixteen" and "sixteen" not in out.text
    assert copy_llms[1].engine.stats().spec_decode_num_accepted_tokens > before


def test_stop_token_id_inside_an_accepted_run_stops_exactly_there(copy_llms):
    plain_out = run(copy_llms[0], [COPY], SamplingParams(max_tokens=20, temperature=0))[0].outputs[0]
    stop_id = plain_out.token_ids[9]
    out = outputs_match(copy_llms, SamplingParams(max_tokens=40, temperature=0, stop_token_ids=[stop_id]))
    assert out.finish_reason == "stop" and out.stop_reason == stop_id


@pytest.mark.parametrize("max_tokens", [1, 2, 5, 7, 13])
def test_max_tokens_reached_mid_run_emits_exactly_max_tokens(copy_llms, max_tokens):
    out = outputs_match(copy_llms, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    assert len(out.token_ids) == max_tokens and out.finish_reason == "length"


def test_k_larger_than_tokens_left_never_drafts_past_max_tokens(copy_llms):
    spec = copy_llms[1]
    seen = []
    original = spec.engine.spec.proposer.propose

    def spy(context, k):
        seen.append(k)
        return original(context, k)

    spec.engine.spec.proposer.propose = spy
    try:
        out = outputs_match(copy_llms, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    finally:
        spec.engine.spec.proposer.propose = original
    assert len(out.token_ids) == 4
    assert seen and max(seen) <= 3      # 8 asked for, but one token of the target's own always follows


def test_logprobs_of_accepted_tokens_match_plain_decoding(copy_llms):
    plain, spec = copy_llms
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=2)
    a, b = run(plain, [COPY], params)[0].outputs[0], run(spec, [COPY], params)[0].outputs[0]
    assert a.token_ids == b.token_ids
    for da, db in zip(a.logprobs, b.logprobs):
        assert da.keys() == db.keys()
        for t in da:
            assert abs(da[t].logprob - db[t].logprob) < 1e-3


def test_abort_after_verification_steps_frees_every_block(copy_llms):
    eng = copy_llms[1].engine
    before = eng.stats().spec_decode_num_drafts
    for i in range(4):
        eng.add_request(f"a{i}", COPY, SamplingParams(max_tokens=60, temperature=0, ignore_eos=True))
    while eng.stats().spec_decode_num_drafts == before:
        eng.step()
    assert eng.block_manager.num_used_blocks() > 0
    eng.step()
    for i in range(4):
        eng.abort_request(f"a{i}")
    assert eng.block_manager.num_used_blocks() == 0
    assert eng.step() == []


def test_counters_count_drafts_proposed_and_accepted_tokens(copy_llms):
    spec = copy_llms[1]
    before = spec.engine.stats()
    steps = []
    original = spec.engine.scheduler.schedule

    def spy():
        batch = original()
        steps.append(batch.total_tokens)
        return batch

    spec.engine.scheduler.schedule = spy
    try:
        out = run(spec, [COPY], SamplingParams(max_tokens=48, temperature=0, ignore_eos=True))[0].outputs[0]
    finally:
        spec.engine.scheduler.schedule = original
    st = spec.engine.stats()
    drafts = st.spec_decode_num_drafts - before.spec_decode_num_drafts
    proposed = st.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens
    accepted = st.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens
    per_pos = [a - b for a, b in zip(st.spec_decode_num_accepted_tokens_per_pos,
                                     before.spec_decode_num_accepted_tokens_per_pos)]
    assert 0 < accepted <= proposed <= 8 * drafts
    assert sum(per_pos) == accepted and per_pos == sorted(per_pos, reverse=True)
    # One prefill step, then decode steps: those with drafts (one per verification round) ran
    # 1 + their drafts tokens; each step emitted its accepted drafts plus one token.
    decode_steps = [n for n in steps[1:] if n]
    assert sum(n > 1 for n in decode_steps) == drafts
    assert sum(decode_steps) == len(decode_steps) + proposed
    assert len(out.token_ids) == 1 + len(decode_steps) + accepted
    assert st.generation_tokens - before.generation_tokens == len(out.token_ids)


# -- sampling: the distribution is the target's -------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory, bundled_tokenizer):
    from oracle import make_tiny_model
    folder = str(tmp_path_factory.mktemp("tiny-llama-spec"))
    make_tiny_model("llama", folder, bundled_tokenizer, seed=3)
    return folder


class FixedProposer:
    """Always proposes the same drafts, so every decode step is a verification round."""

    def __init__(self, drafts):
        self.drafts = drafts

    def propose(self, context, k):
        return self.drafts[:k]


def test_sampled_tokens_follow_the_target_distribution(tiny_llama):
    """temperature 1, top_k 5, 3000 seeded samples: the token after a verified draft is distributed
    as the target's (chi-square against the exact probabilities from a full forward pass)."""
    from tokenfab.model.llama import full_logits

    llm = LLM(tiny_llama, max_model_len=64, num_kv_blocks=2048, max_num_seqs=256, max_num_batched_tokens=4096,
              speculative_config={"method": "ngram", "num_speculative_tokens": 2, "max_batch_size": 256,
                                  "max_step_rows": 4096,
                                  "adaptive": False})
    prompt = llm.engine.tokenize("the quick brown fox")
    model = llm.engine.model

    def top5(ids):
        logits = full_logits(model, ids)[-1]
        v, i = logits.topk(5)
        return i.tolist(), torch.softmax(v, dim=-1).tolist()

    ids0, p0 = top5(prompt)
    a = ids0[0]                          # condition on the most likely first token
    ids1, p1 = top5(prompt + [a])
    d1 = ids1[1]                         # a draft of moderate probability: accepted and rejected often
    ids2, p2 = top5(prompt + [a, d1])
    llm.engine.spec.proposer = FixedProposer([d1, ids2[0]])

    n = 3000
    params = SamplingParams(n=n, seed=11, max_tokens=3, temperature=1.0, top_k=5, ignore_eos=True)
    outs = run(llm, [prompt], params)[0].outputs
    assert llm.engine.stats().spec_decode_num_drafts > 0
    first = [sum(o.token_ids[0] == t for o in outs) for t in ids0]
    after_a = [o.token_ids for o in outs if o.token_ids[0] == a]
    second = [sum(t[1] == x for t in after_a) for x in ids1]
    third = [sum(t[2] == x for t in after_a if t[1] == d1) for x in ids2]
    assert sum(first) == n and sum(second) == len(after_a) and sum(third) == sum(t[1] == d1 for t in after_a)
    chi2_4 = 18.47                       # the chi-square distribution's upper 0.1% point, 4 degrees of freedom
    assert chi_square(first, p0) < chi2_4, (first, p0)
    assert chi_square(second, p1) < chi2_4, (second, p1)
    assert sum(third) > 100 and chi_square(third, p2) < chi2_4, (third, p2)


def chi_square(counts, probs) -> float:
    total = sum(counts)
    return sum((c - total * p) ** 2 / (total * p) for c, p in zip(counts, probs))


def test_bad_speculative_config_is_rejected_before_loading(bundled_files):
    with pytest.raises(ValueError, match="method must be one of"):
        LLM(loaded=bundled_files, speculative_config={"method": "medusa"})


def test_layerskip_deeper_than_the_model_is_a_clear_error(tiny_llama):
    with pytest.raises(ValueError, match=r"num_layers must be in \[1, 1\] for this model \(2 layers\), got 2"):
        LLM(tiny_llama, max_model_len=64, num_kv_blocks=16,
            speculative_config={"method": "layerskip", "num_layers": 2})


# -- /metrics and bench serve -------------------------------------------------------------------------
def test_server_metrics_and_bench_scrape_report_acceptance(copy_llms):
    import httpx

    from tokenfab.bench import spec_metrics
    from tokenfab.server.app import build_app
    from tokenfab.server.config import ServerConfig
    from tokenfab.server.launch import ServerThread

    spec = copy_llms[1]
    with ServerThread(build_app(spec.engine, ServerConfig(access_log=False))) as srv:
        before = spec_metrics.scrape(srv.url + "/v1")
        body = {"model": spec.engine.model_path, "prompt": COPY, "max_tokens": 32, "temperature": 0,
                "ignore_eos": True}
        models = httpx.get(srv.url + "/v1/models", timeout=60).json()
        body["model"] = models["data"][0]["id"]
        r = httpx.post(srv.url + "/v1/completions", json=body, timeout=300)
        assert r.status_code == 200, r.text
        after = spec_metrics.scrape(srv.url)
        text = httpx.get(srv.url + "/metrics", timeout=60).text
    assert 'tokenfab:spec_decode_num_accepted_tokens_per_pos_total{model_name=' in text and 'position="0"' in text
    st = spec.engine.stats()
    assert after["spec_decode_num_accepted_tokens"] == st.spec_decode_num_accepted_tokens
    acc = spec_metrics.acceptance(before, after)
    assert acc is not None and 0 < acc["acceptance_rate"] <= 1 and acc["mean_accepted_length"] > 1
    assert acc["acceptance_rate_per_pos"][0] >= acc["acceptance_rate_per_pos"][-1]
    assert spec.engine.block_manager.num_used_blocks() == 0


def test_http_speculative_field_opts_a_request_out_and_rejects_non_bool(copy_llms):
    """`speculative` (vLLM-style extra field) on /v1/completions and /v1/chat/completions maps to
    SamplingParams(speculative=...): false never drafts, the default does, a string is a 400."""
    import httpx

    from tokenfab.server.app import build_app
    from tokenfab.server.config import ServerConfig
    from tokenfab.server.launch import ServerThread

    spec = copy_llms[1]
    with ServerThread(build_app(spec.engine, ServerConfig(access_log=False))) as srv:
        model = httpx.get(srv.url + "/v1/models", timeout=60).json()["data"][0]["id"]
        base = {"model": model, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
        routes = [("/v1/completions", {**base, "prompt": COPY}),
                  ("/v1/chat/completions", {**base, "messages": [{"role": "user", "content": COPY}]})]
        for path, body in routes:
            before = spec.engine.stats().spec_decode_num_drafts
            r = httpx.post(srv.url + path, json={**body, "speculative": False}, timeout=300)
            assert r.status_code == 200, r.text
            assert spec.engine.stats().spec_decode_num_drafts == before, path
        before = spec.engine.stats().spec_decode_num_drafts
        r = httpx.post(srv.url + "/v1/completions", json=routes[0][1], timeout=300)
        assert r.status_code == 200, r.text
        assert spec.engine.stats().spec_decode_num_drafts > before
        r = httpx.post(srv.url + "/v1/completions", json={**routes[0][1], "speculative": "no"}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "speculative", r.text
    assert spec.engine.block_manager.num_used_blocks() == 0

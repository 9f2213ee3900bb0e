"""Speculative decoding's pieces on their own: the n-gram proposer, the acceptance rules' output
distribution (exactly the target's), the adaptive policy and the config's validation."""
import random

import pytest
import torch

from tokenfab.config import SpeculativeConfig
from tokenfab.engine.sampler import Sampler
from tokenfab.engine.sequence import Sequence, SequenceStatus
from tokenfab.engine.spec.decoder import SpecDecoder
from tokenfab.engine.spec.ngram import NgramProposer
from tokenfab.engine.spec.policy import (BACKOFF_MIN, MIN_GAIN, ROW_COST, START_RATE, AdaptivePolicy, SeqSpecState,
                                         StepCosts, best_k, expected_gain)
from tokenfab.engine.spec.verify import accept_greedy, accept_sampled, target_probs
from tokenfab.sampling import SamplingParams

# Upper 0.1% points of the chi-square distribution by degrees of freedom (tables).
CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52}


def chi_square(counts: list[int], probs: list[float]) -> float:
    n = sum(counts)
    return sum((c - n * p) ** 2 / (n * p) for c, p in zip(counts, probs) if p > 0)


def test_ngram_proposes_what_followed_the_latest_match():
    prop = NgramProposer(lookup_min=1, lookup_max=3)
    #           0  1  2  3  4  5  6  7  8  9
    context = [5, 6, 7, 8, 9, 5, 6, 7, 1, 5, 6, 7]
    assert prop.propose(context, 2) == [1, 5]       # latest earlier "5 6 7" is at 5..7, followed by 1
    assert prop.propose(context, 10) == [1, 5, 6, 7]  # cut at the end of the context
    assert prop.propose([1, 2, 3, 4], 3) == []      # nothing repeats
    assert prop.propose([4, 4], 3) == [4]           # n = 1 still matches
    assert NgramProposer(2, 3).propose([1, 2, 3, 9, 3], 3) == []  # "9 3" never occurred; n=1 not allowed


def _ngram_by_definition(context, k, lookup_min, lookup_max):
    """The longest n in lookup_max..lookup_min whose suffix occurred earlier; what followed its latest occurrence."""
    L = len(context)
    for n in range(min(lookup_max, L - 1), lookup_min - 1, -1):
        starts = [i for i in range(L - n) if context[i:i + n] == context[L - n:]]
        if starts:
            return context[starts[-1] + n:starts[-1] + n + k]
    return []


def test_ngram_matches_its_definition_on_random_contexts():
    rng = random.Random(7)
    for _ in range(3000):
        vocab, lo = rng.choice([2, 3, 5, 50]), rng.randint(1, 4)
        context = [rng.randrange(vocab) for _ in range(rng.randint(0, 40))]
        hi, k = rng.randint(lo, 6), rng.randint(1, 5)
        assert NgramProposer(lo, hi).propose(context, k) == _ngram_by_definition(context, k, lo, hi), (context, lo, hi, k)


def test_greedy_acceptance_keeps_the_matching_prefix_and_the_targets_next_token():
    logits = torch.full((4, 10), -5.0)
    for row, best in enumerate([3, 4, 7, 2]):
        logits[row, best] = 5.0
    assert accept_greedy(logits, [3, 4, 7]) == ([3, 4, 7], 2)   # all accepted, bonus from the last row
    assert accept_greedy(logits, [3, 9, 7]) == ([3], 4)         # first mismatch is replaced
    assert accept_greedy(logits, [1, 4, 7]) == ([], 3)


def test_rejection_sampling_emits_exactly_the_target_distribution():
    # Two positions over 5 tokens; the drafts are a deterministic guess (q a point mass) of
    # moderate probability, so both branches (accept, reject) run often.
    p0 = torch.tensor([0.1, 0.4, 0.3, 0.15, 0.05])
    p1 = torch.tensor([0.25, 0.05, 0.3, 0.3, 0.1])
    p2 = torch.tensor([0.6, 0.1, 0.1, 0.1, 0.1])
    probs = torch.stack([p0, p1, p2])
    drafts = [2, 3]
    gen = torch.Generator().manual_seed(1234)
    first, second_given_d1 = [0] * 5, [0] * 5
    for _ in range(4000):
        accepted, nxt = accept_sampled(probs, drafts, gen)
        tokens = accepted + [nxt]
        first[tokens[0]] += 1
        if tokens[0] == drafts[0]:
            second_given_d1[tokens[1]] += 1
    assert chi_square(first, p0.tolist()) < CHI2_999[4], first
    assert chi_square(second_given_d1, p1.tolist()) < CHI2_999[4], second_given_d1


def test_rejection_sampling_with_a_draft_distribution_matches_the_target():
    # The general rule (a draft model's q): accept with min(1, p/q), else draw from max(0, p - q).
    p0 = torch.tensor([0.5, 0.2, 0.2, 0.1])
    q0 = torch.tensor([0.1, 0.6, 0.2, 0.1])
    p1 = torch.tensor([0.25, 0.25, 0.25, 0.25])
    gen = torch.Generator().manual_seed(7)
    counts = [0] * 4
    for _ in range(4000):
        d = int(torch.multinomial(q0, 1, generator=gen))
        accepted, nxt = accept_sampled(torch.stack([p0, p1]), [d], gen, draft_probs=q0[None])
        counts[(accepted + [nxt])[0]] += 1
    assert chi_square(counts, p0.tolist()) < CHI2_999[3], counts


def test_target_probs_apply_temperature_top_k_top_p_and_min_p_as_the_sampler():
    x = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.06, 0.04]]))
    assert torch.allclose(target_probs(x, SamplingParams(temperature=1.0)), torch.exp(x), atol=1e-6)
    top2 = target_probs(x, SamplingParams(temperature=1.0, top_k=2))
    assert torch.allclose(top2, torch.tensor([[4 / 7, 3 / 7, 0, 0, 0]]), atol=1e-6)
    nucleus = target_probs(x, SamplingParams(temperature=1.0, top_p=0.75))   # 0.4 + 0.3 < 0.75: three kept
    assert torch.allclose(nucleus, torch.tensor([[4 / 9, 3 / 9, 2 / 9, 0, 0]]), atol=1e-6)
    minp = target_probs(x, SamplingParams(temperature=1.0, min_p=0.45))     # >= 0.45 * 0.4 kept
    assert torch.allclose(minp, torch.tensor([[4 / 9, 3 / 9, 2 / 9, 0, 0]]), atol=1e-6)
    hot = target_probs(x, SamplingParams(temperature=2.0))
    assert torch.allclose(hot, torch.softmax(x / 2, dim=-1), atol=1e-6)


def test_adaptive_k_follows_acceptance():
    pol = AdaptivePolicy(k_max=8, max_batch_size=4)
    good, fair, bad = SeqSpecState(), SeqSpecState(), SeqSpecState()
    for step in range(10):
        pol.observe(good, 4, 4, step)
        pol.observe(fair, 4, 2, step)                 # 2 of 3 tested drafts accepted
        pol.observe(bad, 4, 0, step)
    k_good, k_fair = pol.k_for(good, 10, ROW_COST), pol.k_for(fair, 10, ROW_COST)
    # the k that maximises expected tokens per unit of step cost (policy.expected_gain)
    assert k_good == max(range(1, 9), key=lambda k: expected_gain(0.95, k, ROW_COST))
    assert 1 <= k_fair < k_good
    assert pol.k_for(bad, 10, ROW_COST) == 0
    assert pol.step_allows(4) and not pol.step_allows(5)


@pytest.mark.parametrize("a", [i / 20 for i in range(20)])
@pytest.mark.parametrize("cost", [0.0, 0.06, 0.2, 0.42, 1.0])
def test_best_k_is_the_k_of_largest_gain_and_none_below_min_gain(a, cost):
    gains = {k: expected_gain(a, k, cost) for k in range(1, 5)}
    k = best_k(a, cost, 4)
    if max(gains.values()) <= MIN_GAIN:
        assert k == 0
    else:
        assert gains[k] == max(gains.values())


def test_a_rejecting_sequence_of_a_costly_proposer_backs_off_then_probes():
    pol = AdaptivePolicy(k_max=4, max_batch_size=4, draft_cost=0.1)   # no free shadow drafts: back-off
    bad = SeqSpecState()
    for step in range(10):
        pol.observe(bad, 4, 0, step)
    assert pol.k_for(bad, 10, pol.cost(1)) == 0      # not worth a single draft: paused
    assert pol.k_for(bad, 11, pol.cost(1)) == 0
    assert pol.k_for(bad, 10 + BACKOFF_MIN, pol.cost(1)) >= 1     # and probes again later


def test_a_free_proposer_watches_with_shadow_drafts_instead_of_backing_off():
    pol = AdaptivePolicy(k_max=4, max_batch_size=4)
    st = SeqSpecState()
    for step in range(10):
        pol.observe(st, 4, 0, step)
    assert pol.shadows and pol.k_for(st, 10, 0.2) == 0 and st.paused_until == 0
    for step in range(11, 14):                   # its shadow drafts match: the text turned copy-heavy
        pol.observe(st, 1, 1, step)
    assert pol.k_for(st, 14, 0.2) >= 2


def test_a_costly_proposer_needs_higher_acceptance_to_draft():
    cheap, costly = AdaptivePolicy(4, 4), AdaptivePolicy(4, 4, draft_cost=0.8)
    assert cheap.k_for(SeqSpecState(rate=0.8), 0, cheap.cost(1)) >= 2
    assert costly.k_for(SeqSpecState(rate=0.8), 0, costly.cost(1)) == 0


def test_step_costs_measure_a_draft_row_against_a_plain_step_of_as_many_sequences():
    costs = StepCosts()
    assert costs.row_cost(1) is None
    for t in (0.020, 0.020, 0.019, 0.090):        # plain, 1 sequence (one outlier: the median ignores it)
        costs.observe(1, 0, t)
    for t in (0.024, 0.025, 0.023):               # plain, 4 sequences
        costs.observe(4, 0, t)
    assert costs.row_cost(1) is None              # no verification measured yet
    costs.observe(1, 4, 0.0256)                   # 1 sequence + 4 drafts: 1.4 ms per draft row
    costs.observe(4, 4, 0.0284)                   # 4 sequences + 4 drafts: 1.1 ms per row
    costs.observe(1, 2, 0.0230)                   # 1.5 ms per row
    assert costs.plain_seconds(1) == pytest.approx(0.020)
    assert costs.plain_seconds(2) == pytest.approx(0.020 + (0.024 - 0.020) / 3)   # interpolated
    assert costs.plain_seconds(8) == pytest.approx(0.024)                         # nearest measured
    assert costs.row_cost(1) == pytest.approx(0.0014 / 0.020)         # the median per-row time
    assert costs.row_cost(4) == pytest.approx(4 * 0.0014 / 0.024)    # against a sequence's share of the step


def _measured_policy(plain_1: float, plain_4: float, per_row: float) -> AdaptivePolicy:
    pol = AdaptivePolicy(k_max=4, max_batch_size=4)
    pol.observe_step(1, 0, plain_1)
    pol.observe_step(4, 0, plain_4)
    pol.observe_step(1, 4, plain_1 + 4 * per_row)
    return pol


def test_low_acceptance_drafts_alone_but_not_in_the_tail_of_a_batch():
    # 20 ms plain step alone, 24 ms with 4 sequences, 1.4 ms per draft row: a row costs 0.07 of a lone
    # sequence's step but 0.23 of a sequence's share of the 4-sequence step.
    pol = _measured_policy(0.020, 0.024, 0.0014)
    assert pol.cost(1) == pytest.approx(0.07) and pol.cost(4) == pytest.approx(4 * 0.0014 / 0.024)
    st = SeqSpecState(rate=0.24)                  # open-ended text's acceptance
    assert pol.k_for(st, 0, pol.cost(1)) >= 1     # (1 + .24) / 1.07 = 1.16
    assert pol.k_for(st, 0, pol.cost(4)) == 0     # (1 + .24) / 1.23 = 1.01: not worth a row
    assert pol.k_for(SeqSpecState(rate=0.9), 0, pol.cost(4)) == 4   # copy-heavy pays even there


def test_the_measured_cost_replaces_the_kernels_prior():
    pol = AdaptivePolicy(k_max=4, max_batch_size=4, row_cost=0.06)
    assert pol.cost(1) == 0.06
    pol = _measured_policy(0.010, 0.012, 0.005)   # rows far dearer than the kernel declares
    assert pol.cost(1) == pytest.approx(0.5)
    assert pol.k_for(SeqSpecState(rate=0.5), 0, pol.cost(1)) == 0


def test_new_sequences_start_at_the_engines_recent_acceptance():
    pol = AdaptivePolicy(k_max=4, max_batch_size=4)
    assert pol.new_state().rate == START_RATE
    older = SeqSpecState()
    for step in range(30):                        # sequences keep rejecting
        pol.observe(older, 4, 0, step)
    fresh = pol.new_state()
    assert fresh.rate < 0.05                      # starts pessimistic
    assert pol.k_for(fresh, 30, 0.2) == 0
    for step in range(30, 60):                    # ... and optimistic again after accepting rounds
        pol.observe(older, 4, 4, step)
    assert pol.new_state().rate > 0.9


@pytest.mark.parametrize("bad, message", [
    ({"method": "eagle"}, "method must be one of"),
    ({"num_speculative_tokens": 4}, "needs a method"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be a positive integer"),
    ({"method": "ngram", "prompt_lookup_min": 5, "prompt_lookup_max": 2}, "prompt_lookup_min (5) must be <="),
    ({"method": "ngram", "lookahead": 2}, "unknown speculative_config key"),
    ("ngram", "must be a dict"),
])
def test_bad_speculative_config_is_a_clear_error(bad, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        SpeculativeConfig.from_dict(bad)


def _decoding(prompt: list[int], rate: float | None = None) -> Sequence:
    seq = Sequence("r", 0, prompt, SamplingParams(max_tokens=16, temperature=0), max_tokens=16)
    seq.num_computed_tokens = seq.num_tokens - 1          # one token to decode
    seq.status = SequenceStatus.RUNNING
    if rate is not None:
        seq.spec_state = SeqSpecState(rate=rate)
    return seq


def _sample(dec: SpecDecoder, seq: Sequence, token: int) -> None:
    """The target samples `token` for `seq` (a plain greedy row whose argmax it is)."""
    logits = torch.zeros(1, 100)
    logits[0, token] = 1.0
    assert dec.sample(Sampler([], 100), logits, [seq])[0][0].token_id == token


def test_a_shadow_draft_moves_the_sequences_rate_but_no_counter():
    dec = SpecDecoder(SpeculativeConfig(method="ngram"), max_model_len=1024, vocab_size=100)
    seq = _decoding([1, 2, 3, 1, 2, 3, 1, 2], rate=0.0)    # ngram would draft 3; at rate 0 it does not
    dec.propose([seq])
    assert seq.spec_tokens == [] and seq.spec_state.shadow == 3
    _sample(dec, seq, 3)                                  # the target agrees: the draft would have been accepted
    assert seq.spec_state.rate == pytest.approx(0.5) and seq.spec_state.shadow is None
    assert dec.stats.num_drafts == dec.stats.num_draft_tokens == 0


def test_above_max_batch_size_one_sequence_per_step_shadows():
    dec = SpecDecoder(SpeculativeConfig(method="ngram", max_batch_size=4), max_model_len=1024, vocab_size=100)
    seqs = [_decoding([1, 2, 3, 1, 2, 3, 1, 2], rate=0.9) for _ in range(5)]
    for step in range(5):
        dec.propose(seqs)
        assert all(s.spec_tokens == [] for s in seqs)      # no drafts in a batch this large
        assert [s.spec_state.shadow for s in seqs].count(3) == 1
    assert dec.stats.num_drafts == 0

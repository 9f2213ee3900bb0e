"""Speculative decoding's pieces on their own: the n-gram proposer, the acceptance rules' output
distribution (exactly the target's), the adaptive policy and the config's validation."""
import pytest
import torch

from tokenfab.engine.spec.config import SpeculativeConfig
from tokenfab.engine.spec.ngram import NgramProposer
from tokenfab.engine.spec.policy import ROW_COST, AdaptivePolicy, SeqSpecState, expected_gain
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


def test_adaptive_k_follows_acceptance_and_backs_off_a_rejecting_sequence():
    pol = AdaptivePolicy(k_max=8, max_batch_size=4)
    good, fair, bad = SeqSpecState(), SeqSpecState(), SeqSpecState()
    for step in range(10):
        pol.observe(good, 4, 4, step)
        pol.observe(fair, 4, 2, step)                 # 2 of 3 tested drafts accepted
        pol.observe(bad, 4, 0, step)
    k_good, k_fair = pol.k_for(good, 10), pol.k_for(fair, 10)
    # the k that maximises expected tokens per unit of step cost (policy.expected_gain)
    assert k_good == max(range(1, 9), key=lambda k: expected_gain(0.95, k, ROW_COST))
    assert 1 <= k_fair < k_good
    assert pol.k_for(bad, 10) == 0                  # not worth a single draft: paused
    assert pol.k_for(bad, 11) == 0
    assert pol.k_for(bad, 10 + 256) >= 1            # and tries again later
    assert pol.step_allows(4) and not pol.step_allows(5)


def test_a_costly_proposer_needs_higher_acceptance_to_draft():
    cheap, costly = AdaptivePolicy(4, 4), AdaptivePolicy(4, 4, draft_cost=0.8)
    st = SeqSpecState(rate=0.8)
    assert cheap.k_for(SeqSpecState(rate=0.8), 0) >= 2
    assert costly.k_for(st, 0) == 0


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

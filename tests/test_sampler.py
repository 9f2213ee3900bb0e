"""Sampler properties: greedy exactness, seeds, truncation sets, frequencies, penalties, min_tokens, logprobs."""
import math

import pytest
import torch

from tokenfab.engine.sampler import SampledToken, Sampler, SampleRow, greedy_ids, make_generator
from tokenfab.sampling import SamplingParams

EOS = 3


def row(params: SamplingParams, prompt=(), output=(), seeded: bool = True) -> SampleRow:
    gen = make_generator(params.seed) if seeded and params.seed is not None else None
    return SampleRow(params, list(prompt), list(output), gen)


def random_logits(n: int, vocab: int, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, vocab, generator=g) * scale


def softmax_list(x: torch.Tensor) -> list[float]:
    return torch.softmax(x.double(), dim=-1).tolist()


# ---------------------------------------------------------------------------------------------- greedy
def test_all_greedy_batch_is_argmax_with_ties_to_lowest_id():
    logits = random_logits(6, 40)
    logits[2, 7] = logits[2, 9] = logits[2].max() + 1.0  # a tie: the lower id must win
    rows = [row(SamplingParams(temperature=0.0)) for _ in range(6)]
    out = Sampler([EOS], 40)(logits, rows)
    assert [t.token_id for t in out] == logits.argmax(dim=-1).tolist()
    assert out[2].token_id == 7
    assert all(t.logprob is None and t.top_logprobs is None for t in out)


def test_greedy_ids_equal_argmax_on_vocab_wide_rows_full_of_ties():
    # bf16-rounded logits (what the bf16 LM-head kernel returns) tie often; the vectorized max must
    # still pick the first of the tied maxima, and a NaN, as argmax does
    logits = (random_logits(64, 49152, seed=5) * 2).to(torch.bfloat16).float()
    logits[3, 40000] = logits[3, 123] = logits[3].max() + 1.0
    logits[5, 77] = float("nan")
    assert greedy_ids(logits) == logits.argmax(dim=-1).tolist()
    assert greedy_ids(logits)[3] == 123 and greedy_ids(logits)[5] == 77


def test_greedy_rows_stay_argmax_when_batched_with_random_rows():
    logits = random_logits(8, 50, seed=1)
    rows = [row(SamplingParams(temperature=0.0 if i % 2 == 0 else 1.0)) for i in range(8)]
    out = Sampler([EOS], 50)(logits, rows)
    for i in range(0, 8, 2):
        assert out[i].token_id == int(logits[i].argmax())


def test_padded_vocab_columns_are_never_sampled():
    logits = torch.zeros(4, 64)
    logits[:, 50:] = 100.0  # padding columns of the LM head beyond the real vocabulary
    rows = [row(SamplingParams(temperature=0.0)), row(SamplingParams(temperature=1.0))] * 2
    out = Sampler([EOS], 50)(logits, rows)
    assert all(t.token_id < 50 for t in out)


# ---------------------------------------------------------------------------------------------- seeds
SEEDED_VARIANTS = [
    dict(temperature=1.0),
    dict(temperature=0.8, top_k=10),
    dict(temperature=1.2, top_p=0.7),
    dict(temperature=1.0, min_p=0.05),
    dict(temperature=0.9, top_k=20, top_p=0.9, min_p=0.01, repetition_penalty=1.3, frequency_penalty=0.5),
]


def _seeded_run(params: SamplingParams, logits_seq: list[torch.Tensor], neighbours: int) -> list[int]:
    """Draw one token per step for a seeded row, alongside `neighbours` unrelated rows."""
    sampler = Sampler([EOS], logits_seq[0].shape[-1])
    me = row(params, prompt=[5, 6, 7])
    others = [row(SamplingParams(temperature=0.5 + 0.1 * j, top_k=5 * j, seed=1000 + j if j % 2 else None))
              for j in range(neighbours)]
    tokens = []
    for step, lg in enumerate(logits_seq):
        noise = random_logits(neighbours, lg.shape[-1], seed=100 + step)
        batch = torch.cat([noise[: neighbours // 2], lg[None], noise[neighbours // 2:]])
        rows = others[: neighbours // 2] + [me] + others[neighbours // 2:]
        out = sampler(batch, rows)
        tokens.append(out[neighbours // 2].token_id)
        me.output_token_ids.append(tokens[-1])
        for o, t in zip(others, out[: neighbours // 2] + out[neighbours // 2 + 1:]):
            o.output_token_ids.append(t.token_id)
    return tokens


@pytest.mark.parametrize("kw", SEEDED_VARIANTS, ids=lambda kw: ",".join(kw))
def test_seeded_rows_repeat_exactly_alone_and_in_any_batch(kw):
    logits_seq = [random_logits(1, 300, seed=s, scale=2.0)[0] for s in range(30)]
    params = SamplingParams(seed=1234, **kw)
    alone = _seeded_run(params, logits_seq, neighbours=0)
    assert alone == _seeded_run(params, logits_seq, neighbours=0)
    assert alone == _seeded_run(params, logits_seq, neighbours=3)
    assert alone == _seeded_run(params, logits_seq, neighbours=8)
    assert len(set(alone)) > 1  # really random, so repetition is not trivial


def test_different_seeds_give_different_tokens():
    logits_seq = [torch.zeros(300) for _ in range(30)]
    a = _seeded_run(SamplingParams(seed=1), logits_seq, 0)
    b = _seeded_run(SamplingParams(seed=2), logits_seq, 0)
    assert a != b


# ---------------------------------------------------------------------------------------------- truncation
def _allowed(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float) -> set[int]:
    """The allowed set by hand, from one descending sort (min-p, then top-k, then top-p)."""
    probs = softmax_list(logits / temperature)
    order = sorted(range(len(probs)), key=lambda i: -probs[i])
    keep = [i for i in order if probs[i] >= min_p * probs[order[0]]]
    if top_k > 0:
        keep = keep[:top_k]
    if top_p < 1.0:
        total = sum(probs[i] for i in keep)
        nucleus, mass = [], 0.0
        for i in keep:
            if mass >= top_p:
                break
            nucleus.append(i)
            mass += probs[i] / total
        keep = nucleus
    return set(keep)


@pytest.mark.parametrize("temperature,top_k,top_p,min_p", [
    (1.0, 5, 1.0, 0.0), (1.0, -1, 0.6, 0.0), (0.7, -1, 1.0, 0.2), (1.3, 8, 0.8, 0.0), (1.0, 30, 0.9, 0.02),
])
def test_truncation_never_emits_tokens_outside_the_allowed_set(temperature, top_k, top_p, min_p):
    torch.manual_seed(0)
    vocab, n = 200, 4000
    base = random_logits(1, vocab, seed=7, scale=2.0)[0]
    allowed = _allowed(base, temperature, top_k, top_p, min_p)
    assert 1 < len(allowed) < vocab  # the filter really filters, and really samples
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    out = Sampler([EOS], vocab)(base.expand(n, vocab).clone(), [row(params) for _ in range(n)])
    seen = {t.token_id for t in out}
    assert seen <= allowed
    assert len(seen) > 1


@pytest.mark.parametrize("heavy,top_p,min_size", [(500, 0.5, 300), (100, 0.9, 30000)])
def test_top_p_with_a_wide_nucleus_is_exact(heavy, top_p, min_size):
    # A big vocabulary whose nucleus holds hundreds or tens of thousands of tokens: top_p must still
    # be respected exactly, and tokens far down the order must be reachable.
    vocab = 49152
    logits = -1e-5 * torch.arange(vocab, dtype=torch.float32)[None, :]  # distinct values: a definite order
    logits[0, :heavy] += 5.0
    allowed = _allowed(logits[0], 1.0, -1, top_p, 0.0)
    assert len(allowed) > min_size
    torch.manual_seed(1)
    out = Sampler([EOS], vocab)(logits.expand(64, vocab).clone(), [row(SamplingParams(top_p=top_p)) for _ in range(64)])
    assert {t.token_id for t in out} <= allowed
    assert sum(t.token_id >= 64 for t in out) > 32  # not only the first few tokens


def test_top_p_over_a_large_vocab_normalises_by_the_whole_distribution():
    # 4 heavy tokens (0.5, 0.3, 0.12, 0.03) and a 5% tail spread over 4092 tokens. With top_p=0.82
    # the nucleus is {0, 1, 2}: the mass before token 2 is 0.80. Measuring the nucleus against only
    # part of the distribution (e.g. the best candidates' mass) would wrongly drop token 2.
    vocab, n = 4096, 2000
    probs = torch.full((vocab,), 0.05 / (vocab - 4), dtype=torch.float64)
    probs[:4] = torch.tensor([0.5, 0.3, 0.12, 0.03], dtype=torch.float64)
    base = probs.log().float()
    torch.manual_seed(4)
    out = Sampler([EOS], vocab)(base.expand(n, vocab).clone(), [row(SamplingParams(top_p=0.82)) for _ in range(n)])
    freq = torch.bincount(torch.tensor([t.token_id for t in out]), minlength=vocab).double() / n
    expected = torch.zeros(vocab, dtype=torch.float64)
    expected[:3] = probs[:3] / probs[:3].sum()
    assert (freq - expected).abs().max() < 5 * 0.5 / math.sqrt(n)


def test_top_p_row_beside_a_top_k_row_is_renormalised_over_its_own_set():
    vocab = 100
    base = random_logits(1, vocab, seed=3, scale=2.0)[0]
    k_params, p_params = SamplingParams(top_k=3), SamplingParams(top_p=0.5)
    rows = [row(k_params), row(p_params)] * 1000
    torch.manual_seed(2)
    out = Sampler([EOS], vocab)(base.expand(len(rows), vocab).clone(), rows)
    assert {t.token_id for t in out[0::2]} <= _allowed(base, 1.0, 3, 1.0, 0.0)
    assert {t.token_id for t in out[1::2]} <= _allowed(base, 1.0, -1, 0.5, 0.0)


# ---------------------------------------------------------------------------------------------- frequencies
@pytest.mark.parametrize("kw", [dict(temperature=1.0), dict(temperature=0.7, top_k=6), dict(temperature=1.0, top_p=0.8),
                                dict(temperature=1.5, top_k=12, top_p=0.7), dict(temperature=1.0, min_p=0.1)],
                         ids=["t1", "t0.7-k6", "p0.8", "t1.5-k12-p0.7", "minp0.1"])
def test_empirical_frequencies_match_the_softmax(kw):
    vocab, n = 20, 40000
    base = random_logits(1, vocab, seed=11, scale=1.0)[0]
    params = SamplingParams(**kw)
    allowed = _allowed(base, params.temperature, params.top_k, params.top_p, params.min_p)
    probs = softmax_list(base / params.temperature)
    mass = sum(probs[i] for i in allowed)
    expected = [probs[i] / mass if i in allowed else 0.0 for i in range(vocab)]
    torch.manual_seed(3)
    out = Sampler([EOS], vocab)(base.expand(n, vocab).clone(), [row(params) for _ in range(n)])
    counts = torch.bincount(torch.tensor([t.token_id for t in out]), minlength=vocab).double() / n
    # Binomial standard error is at most 0.5/sqrt(n) = 0.0025; allow 5 of them.
    assert max(abs(c - e) for c, e in zip(counts.tolist(), expected)) < 0.0125
    assert all(c == 0 for c, e in zip(counts.tolist(), expected) if e == 0)


def test_seeded_row_frequencies_match_the_softmax():
    vocab, steps = 8, 6000
    base = random_logits(1, vocab, seed=5, scale=1.0)
    r = row(SamplingParams(temperature=1.0, seed=99))
    sampler = Sampler([EOS], vocab)
    tokens = [sampler(base, [r])[0].token_id for _ in range(steps)]
    freq = torch.bincount(torch.tensor(tokens), minlength=vocab).double() / steps
    assert (freq - torch.tensor(softmax_list(base[0]))).abs().max() < 5 * 0.5 / math.sqrt(steps)


# ---------------------------------------------------------------------------------------------- penalties
def test_penalties_change_logits_as_defined():
    vocab = 10
    raw = torch.tensor([[2.0, -1.0, 0.5, -3.0, 1.5, 0.0, 4.0, -0.5, 1.0, 2.5]])
    prompt, output = [0, 1, 1], [2, 3, 2, 2, 6]
    p = SamplingParams(repetition_penalty=1.5, frequency_penalty=0.4, presence_penalty=0.3)
    got = Sampler([EOS], vocab).process_logits(raw, [row(p, prompt, output)])[0].tolist()

    expected = []
    for tok, v in enumerate(raw[0].tolist()):
        if tok in prompt or tok in output:  # repetition: prompt and output
            v = v / 1.5 if v > 0 else v * 1.5
        c = output.count(tok)                # frequency and presence: output only
        v -= 0.4 * c + 0.3 * (c > 0)
        expected.append(v)
    assert got == pytest.approx(expected, abs=1e-6)
    assert raw[0, 0] == 2.0  # the caller's logits are not modified


def test_penalties_apply_only_to_rows_that_ask_for_them():
    raw = random_logits(3, 30, seed=9)
    rows = [row(SamplingParams(), [1, 2], [3, 4]),
            row(SamplingParams(presence_penalty=1.0), [1, 2], [3, 4]),
            row(SamplingParams(repetition_penalty=2.0), [1, 2], [])]
    got = Sampler([EOS], 30).process_logits(raw, rows)
    assert torch.equal(got[0], raw[0])
    assert torch.equal(got[1, [3, 4]], raw[1, [3, 4]] - 1.0) and torch.equal(got[1, 5:], raw[1, 5:])
    assert not torch.equal(got[2, [1, 2]], raw[2, [1, 2]]) and torch.equal(got[2, 3:], raw[2, 3:])


def test_negative_frequency_penalty_makes_greedy_repeat():
    raw = torch.tensor([[1.0, 1.2, 0.0, 0.0]])
    p = SamplingParams(temperature=0.0, frequency_penalty=-0.5)
    assert Sampler([EOS], 4)(raw, [row(p, [], [0])])[0].token_id == 0


# ---------------------------------------------------------------------------------------------- min_tokens
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_min_tokens_suppresses_eos_and_stop_token_ids_until_reached(temperature):
    vocab = 12
    logits = torch.full((1, vocab), -5.0)
    logits[0, EOS] = 20.0
    logits[0, 7] = 19.0
    logits[0, 9] = 0.0
    p = SamplingParams(temperature=temperature, min_tokens=3, stop_token_ids=[7], seed=4)
    sampler = Sampler([EOS], vocab)
    for done in range(3):
        tok = sampler(logits, [row(p, [1], [9] * done)])[0].token_id
        assert tok not in (EOS, 7)
    assert sampler(logits, [row(SamplingParams(temperature=0.0, min_tokens=3), [1], [9] * 3)])[0].token_id == EOS


def test_min_tokens_with_ignore_eos_leaves_eos_alone():
    logits = torch.zeros(1, 8)
    logits[0, EOS] = 10.0
    p = SamplingParams(temperature=0.0, min_tokens=2, ignore_eos=True)
    assert Sampler([EOS], 8)(logits, [row(p)])[0].token_id == EOS


# ---------------------------------------------------------------------------------------------- logprobs
def test_logprobs_are_log_softmax_of_the_raw_logits():
    vocab = 64
    raw = random_logits(4, vocab, seed=21)
    rows = [row(SamplingParams(temperature=0.0, logprobs=5)),
            row(SamplingParams(temperature=0.7, top_k=4, repetition_penalty=1.4, logprobs=3, seed=8), [1, 2], [3]),
            row(SamplingParams(temperature=0.0)),
            row(SamplingParams(temperature=1.0, min_tokens=1, logprobs=0))]
    out = Sampler([EOS], vocab)(raw, rows)
    ref = torch.log_softmax(raw.double(), dim=-1)
    for i, n in [(0, 5), (1, 3), (3, 0)]:
        assert out[i].logprob == pytest.approx(ref[i, out[i].token_id].item(), abs=1e-5)
        top = ref[i].topk(n) if n else None
        expected = dict(zip(top.indices.tolist(), top.values.tolist())) if n else {}
        assert list(out[i].top_logprobs) == list(expected)
        assert list(out[i].top_logprobs.values()) == pytest.approx(list(expected.values()), abs=1e-5)
    assert out[2].logprob is None and out[2].top_logprobs is None


def test_sampled_token_is_a_plain_value():
    t = SampledToken(5, -0.1, {5: -0.1})
    assert (t.token_id, t.logprob, t.top_logprobs) == (5, -0.1, {5: -0.1})


# ------------------------------------------------------------------------------------------ logit_bias
def test_logit_bias_adds_to_the_named_tokens_only_in_its_own_row():
    logits = random_logits(3, 30, seed=7)
    biased = SamplingParams(temperature=0.0, logit_bias={5: 100.0, int(logits[0].argmax()): -100.0})
    rows = [row(biased), row(SamplingParams(temperature=0.0)), row(SamplingParams(temperature=1.0, seed=1))]
    out = Sampler([EOS], 30)(logits, rows)
    assert out[0].token_id == 5
    assert out[1].token_id == int(logits[1].argmax())
    processed = Sampler([EOS], 30).process_logits(logits, rows)
    assert torch.equal(processed[1:], logits[1:])
    assert processed[0, 5] == logits[0, 5] + 100.0


def test_logit_bias_minus_100_bans_a_token_from_random_draws():
    logits = torch.zeros(1, 4)
    p = SamplingParams(temperature=1.0, seed=0, logit_bias={0: -100.0, 1: -100.0})
    gen = make_generator(0)
    drawn = {Sampler([EOS], 4)(logits, [SampleRow(p, [], [], gen)])[0].token_id for _ in range(200)}
    assert drawn == {2, 3}


def test_logit_bias_logprobs_stay_those_of_the_raw_logits():
    logits = random_logits(1, 20, seed=3)
    p = SamplingParams(temperature=0.0, logprobs=1, logit_bias={4: 100.0})
    out = Sampler([EOS], 20)(logits, [row(p)])[0]
    assert out.token_id == 4
    assert out.logprob == pytest.approx(torch.log_softmax(logits[0], -1)[4].item(), abs=1e-6)


@pytest.mark.parametrize("bias", [{1: 100.5}, {1: -1e9}, {-1: 1.0}, {1: float("nan")}, {"1": 2.0}])
def test_logit_bias_out_of_range_is_a_value_error(bias):
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias=bias)

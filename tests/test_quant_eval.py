"""Quality metrics against hand-computed values; per-layer sensitivity; the bundled evaluation text."""
import math

import pytest
import torch
import torch.nn as nn

from tokenfab.quant.eval import compare_logits, kl_histogram_png, next_token_targets, token_stats
from tokenfab.quant.sensitivity import group_names, layer_sensitivity
from tokenfab.quant.text import eval_text_paths, load_eval_text

L3 = math.log(3)
# Two-token vocabulary, four positions. Softmax of [ln 3, 0] is (3/4, 1/4); of [ln 4, 0] is (4/5, 1/5).
BASE = torch.tensor([[L3, 0.0], [L3, 0.0], [L3, 0.0], [0.0, L3]])
CAND = torch.tensor([[L3, 0.0], [0.0, L3], [math.log(4), 0.0], [0.0, L3]])
TARGETS = torch.tensor([0, 0, 1, 1])


def _hand_kl():
    # KL(p || q) = Σ p log(p / q)
    return [0.0,
            0.75 * math.log(0.75 / 0.25) + 0.25 * math.log(0.25 / 0.75),      # = ½ ln 3
            0.75 * math.log(0.75 / 0.8) + 0.25 * math.log(0.25 / 0.2),
            0.0]


def test_per_token_kl_top1_and_target_probabilities_match_hand_values():
    st = token_stats(BASE, CAND, TARGETS)
    assert st.kl.tolist() == pytest.approx(_hand_kl(), abs=1e-6)      # inputs are float32
    assert st.kl[1].item() == pytest.approx(0.5 * L3)
    assert st.same_top1.tolist() == [True, False, True, True]
    assert st.p_base.tolist() == pytest.approx([0.75, 0.75, 0.25, 0.75])
    assert st.p_cand.tolist() == pytest.approx([0.75, 0.25, 0.2, 0.75])


def test_report_summary_statistics_match_hand_values():
    r = compare_logits(BASE, CAND, TARGETS)
    kl = _hand_kl()
    mean = sum(kl) / 4
    std = math.sqrt(sum((k - mean) ** 2 for k in kl) / 3)             # sample std (n - 1)
    assert r.tokens == 4
    assert r.kl_mean == pytest.approx(mean) and r.kl_stderr == pytest.approx(std / 2)
    srt = sorted(kl)
    assert r.kl_median == pytest.approx((srt[1] + srt[2]) / 2)        # even count: mean of the middle two
    assert r.kl_p99 == pytest.approx(srt[2] + 0.97 * (srt[3] - srt[2]))   # rank 0.99 * 3 = 2.97
    assert r.kl_max == pytest.approx(0.5 * L3)
    assert r.same_top1_pct == pytest.approx(75.0)
    assert r.same_top1_stderr_pct == pytest.approx(100 * math.sqrt(0.75 * 0.25 / 3))
    dp = [0.0, -0.5, -0.05, 0.0]
    assert r.dp_mean == pytest.approx(sum(dp) / 4)
    assert r.dp_rms == pytest.approx(math.sqrt(sum(d * d for d in dp) / 4))
    ppl_base = math.exp(-(3 * math.log(0.75) + math.log(0.25)) / 4)
    ppl_cand = math.exp(-(2 * math.log(0.75) + math.log(0.25) + math.log(0.2)) / 4)
    assert r.ppl_base == pytest.approx(ppl_base) and r.ppl_cand == pytest.approx(ppl_cand)
    assert r.ppl_ratio == pytest.approx(ppl_cand / ppl_base)


def test_identical_logits_give_zero_kl_and_full_agreement():
    logits = torch.randn(300, 50, generator=torch.Generator().manual_seed(0))
    r = compare_logits(logits, logits.clone(), torch.zeros(300, dtype=torch.long))
    assert r.kl_max == pytest.approx(0.0, abs=1e-12) and r.same_top1_pct == 100.0
    assert r.ppl_ratio == pytest.approx(1.0) and r.dp_rms == pytest.approx(0.0, abs=1e-12)


def test_chunked_computation_equals_a_direct_one_on_many_rows():
    g = torch.Generator().manual_seed(1)
    base, cand = torch.randn(150, 40, generator=g), torch.randn(150, 40, generator=g)
    st = token_stats(base, cand, torch.randint(0, 40, (150,), generator=g))   # 150 rows: 3 chunks of 64
    p, q = base.double().softmax(-1), cand.double().softmax(-1)
    torch.testing.assert_close(st.kl, (p * (p.log() - q.log())).sum(-1))


def test_mismatched_shapes_are_refused_with_the_shapes_in_the_message():
    with pytest.raises(ValueError, match=r"\[tokens, vocab\]"):
        compare_logits(torch.zeros(3, 5), torch.zeros(3, 6), torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="targets"):
        compare_logits(torch.zeros(3, 5), torch.zeros(3, 5), torch.zeros(2, dtype=torch.long))


def test_next_token_targets_align_logits_rows_with_following_tokens():
    rows, targets = next_token_targets(torch.tensor([5, 6, 7, 8]))
    assert torch.arange(4)[rows].tolist() == [0, 1, 2] and targets.tolist() == [6, 7, 8]


def test_kl_histogram_png_is_written(tmp_path):
    path = kl_histogram_png(torch.rand(500) * 0.01, str(tmp_path / "kl.png"))
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


# ------------------------------------------------------------------------------------------ sensitivity

class TwoPaths(nn.Module):
    """Logits = big(x) + small(x): quantizing `big` (large weights) must disturb the logits more."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.big, self.small = nn.Linear(64, 32, bias=False), nn.Linear(64, 32, bias=False)
        self.big.weight.data = torch.randn(32, 64, generator=g) * 2.0
        self.small.weight.data = torch.randn(32, 64, generator=g) * 0.05
        self.x = torch.randn(20, 64, generator=g)

    def forward(self):
        return self.big(self.x) + self.small(self.x)


def test_layer_sensitivity_ranks_the_large_weight_layer_first_and_restores_the_model():
    model = TwoPaths()
    before = model().detach()
    rows = layer_sensitivity(model, lambda m: m(), "int4-g32")
    assert [r.name for r in rows] == ["big", "small"]
    assert rows[0].kl_mean > 10 * rows[1].kl_mean > 0
    assert type(model.big) is nn.Linear and torch.equal(model().detach(), before)


def test_group_names_by_block_and_by_kind():
    names = ["model.layers.0.q_proj", "model.layers.0.k_proj", "model.layers.1.q_proj"]
    assert group_names(names, "block") == {"model.layers.0": names[:2], "model.layers.1": names[2:]}
    assert group_names(names, "kind") == {"q_proj": [names[0], names[2]], "k_proj": [names[1]]}


# ------------------------------------------------------------------------------------------ eval text

def test_bundled_eval_text_is_real_english_of_modest_size():
    paths = eval_text_paths()
    text = load_eval_text()
    size = sum(len(open(p, "rb").read()) for p in paths)
    assert 50_000 < size <= 200_000
    words = text.split()
    common = sum(w.lower() in {"the", "of", "and", "to", "a", "or", "you", "that", "this", "is"} for w in words)
    assert len(words) > 10_000 and common / len(words) > 0.15          # ordinary English prose statistics
    assert "Free Software Foundation" in text


def test_eval_text_from_a_file_and_cut(tmp_path):
    f = tmp_path / "t.txt"
    f.write_text("hello world " * 10)
    assert load_eval_text(str(f), max_chars=11) == "hello world"
    (tmp_path / "empty.txt").write_text("  ")
    with pytest.raises(ValueError, match="empty"):
        load_eval_text(str(tmp_path / "empty.txt"))

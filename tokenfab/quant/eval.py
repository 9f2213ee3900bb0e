"""Quality of a quantized model against its full-precision base, from two logits tensors.

The metrics follow llama.cpp's `perplexity --kl-divergence`:
- KL(base || candidate) per token: mean ± standard error, median, p99, max;
- "same top-1": how often both models' most likely token agree, in %;
- Δp = p_candidate(correct token) − p_base(correct token): mean and RMS;
- perplexity of each over the correct next tokens, and their ratio.

Definitions used here (and in the tests): the standard error of a mean is the sample standard
deviation (n − 1) over √n; percentiles interpolate linearly between order statistics
(`torch.quantile`), so the median of an even count is the mean of the middle two.
Everything is computed in float64, in row chunks, so a [tokens, 49152] pair fits in modest memory.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

CHUNK_ROWS = 64


@dataclass
class TokenStats:
    """Per-token values, [tokens] each (float64, except `same_top1`)."""
    kl: torch.Tensor
    same_top1: torch.Tensor        # bool
    p_base: torch.Tensor           # probability of the correct next token
    p_cand: torch.Tensor
    nll_base: torch.Tensor         # −log p of the correct next token
    nll_cand: torch.Tensor


def token_stats(base_logits: torch.Tensor, cand_logits: torch.Tensor, targets: torch.Tensor) -> TokenStats:
    """base/cand logits [T, V] over the same tokens; targets [T]: the token that actually came next."""
    if base_logits.shape != cand_logits.shape or base_logits.dim() != 2:
        raise ValueError(f"logits must both be [tokens, vocab]; got {tuple(base_logits.shape)} "
                         f"and {tuple(cand_logits.shape)}")
    if targets.shape != base_logits.shape[:1]:
        raise ValueError(f"targets must be [{base_logits.shape[0]}] (one per logits row), got {tuple(targets.shape)}")
    parts: dict[str, list[torch.Tensor]] = {k: [] for k in ("kl", "same", "lpb", "lpc")}
    for s in range(0, base_logits.shape[0], CHUNK_ROWS):
        lb = torch.log_softmax(base_logits[s:s + CHUNK_ROWS].double(), dim=-1)
        lc = torch.log_softmax(cand_logits[s:s + CHUNK_ROWS].double(), dim=-1)
        t = targets[s:s + CHUNK_ROWS].long().to(lb.device)[:, None]
        parts["kl"].append((lb.exp() * (lb - lc)).sum(-1).clamp_min(0))   # clamp: rounding can dip below 0
        parts["same"].append(lb.argmax(-1) == lc.argmax(-1))
        parts["lpb"].append(lb.gather(1, t)[:, 0])
        parts["lpc"].append(lc.gather(1, t)[:, 0])
    lpb, lpc = torch.cat(parts["lpb"]), torch.cat(parts["lpc"])
    return TokenStats(torch.cat(parts["kl"]), torch.cat(parts["same"]), lpb.exp(), lpc.exp(), -lpb, -lpc)


def mean_and_stderr(x: torch.Tensor) -> tuple[float, float]:
    x = x.double()
    n = x.numel()
    mean = x.mean().item()
    return mean, (x.std(unbiased=True).item() / math.sqrt(n)) if n > 1 else float("nan")


@dataclass
class QualityReport:
    tokens: int
    kl_mean: float
    kl_stderr: float
    kl_median: float
    kl_p99: float
    kl_max: float
    same_top1_pct: float
    same_top1_stderr_pct: float
    dp_mean: float
    dp_rms: float
    ppl_base: float
    ppl_cand: float
    ppl_ratio: float

    def as_dict(self) -> dict:
        return asdict(self)

    def rows(self) -> list[tuple[str, str]]:
        """(metric, value) pairs for a table, formatted as llama.cpp prints them."""
        return [
            ("tokens", str(self.tokens)),
            ("PPL(base)", f"{self.ppl_base:.4f}"),
            ("PPL(cand)", f"{self.ppl_cand:.4f}"),
            ("PPL ratio", f"{self.ppl_ratio:.4f}"),
            ("mean KL", f"{self.kl_mean:.6f} ± {self.kl_stderr:.6f}"),
            ("median KL", f"{self.kl_median:.6f}"),
            ("p99 KL", f"{self.kl_p99:.6f}"),
            ("max KL", f"{self.kl_max:.6f}"),
            ("same top-1", f"{self.same_top1_pct:.2f} ± {self.same_top1_stderr_pct:.2f} %"),
            ("mean Δp", f"{100 * self.dp_mean:+.3f} %"),
            ("RMS Δp", f"{100 * self.dp_rms:.3f} %"),
        ]


def summarize(stats: TokenStats) -> QualityReport:
    n = stats.kl.numel()
    if n == 0:
        raise ValueError("no tokens to compare")
    kl_mean, kl_err = mean_and_stderr(stats.kl)
    top1 = stats.same_top1.double()
    p = top1.mean().item()
    dp = stats.p_cand - stats.p_base
    ppl_base = math.exp(stats.nll_base.mean().item())
    ppl_cand = math.exp(stats.nll_cand.mean().item())
    return QualityReport(
        tokens=n, kl_mean=kl_mean, kl_stderr=kl_err,
        kl_median=torch.quantile(stats.kl, 0.5).item(), kl_p99=torch.quantile(stats.kl, 0.99).item(),
        kl_max=stats.kl.max().item(),
        same_top1_pct=100 * p, same_top1_stderr_pct=100 * (math.sqrt(p * (1 - p) / (n - 1)) if n > 1 else float("nan")),
        dp_mean=dp.mean().item(), dp_rms=dp.pow(2).mean().sqrt().item(),
        ppl_base=ppl_base, ppl_cand=ppl_cand, ppl_ratio=ppl_cand / ppl_base)


def compare_logits(base_logits: torch.Tensor, cand_logits: torch.Tensor, targets: torch.Tensor) -> QualityReport:
    """The whole report in one call; use `token_stats` when the per-token KL is wanted too (plots)."""
    return summarize(token_stats(base_logits, cand_logits, targets))


def next_token_targets(token_ids: torch.Tensor) -> tuple[slice, torch.Tensor]:
    """For logits over `token_ids` [T]: the rows that have a next token, and those tokens.

    logits[:-1] predict token_ids[1:]: `rows, targets = next_token_targets(ids); logits[rows]`.
    """
    return slice(0, token_ids.shape[0] - 1), token_ids[1:]


def kl_histogram_png(kl: torch.Tensor, path: str, title: str = "KL(base || candidate) per token") -> str:
    """Save a log-x histogram of per-token KL as a PNG (matplotlib, headless)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kl = kl.double().clamp_min(1e-10).cpu().numpy()
    fig, ax = plt.subplots(figsize=(7, 4))
    bins = torch.logspace(-8, max(1.0, math.log10(kl.max()) + 0.1), 60).numpy()
    ax.hist(kl, bins=bins, color="#3b75af")
    ax.set_xscale("log")
    ax.set_xlabel("KL divergence (nats)")
    ax.set_ylabel("tokens")
    ax.set_title(title)
    ax.axvline(kl.mean(), color="#c44e52", linestyle="--", label=f"mean {kl.mean():.4g}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

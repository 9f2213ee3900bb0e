"""Sampler: turns one step's logits (one row per sequence) into next tokens.

Pipeline per row, in vLLM's order:
  raw logits ─► logprobs (log_softmax of the *raw* logits, when asked)
             ─► min_tokens mask (EOS and stop_token_ids get -inf until min_tokens outputs)
             ─► repetition penalty (prompt + output tokens), frequency/presence penalties (output tokens)
             ─► greedy rows: argmax
             ─► random rows: temperature ─► min-p ─► top-k ─► top-p ─► draw

The common case (every row plain greedy) is a single batched argmax. Unseeded random rows share one
batched draw; a seeded row is processed and drawn on its own, with its own generator, so its tokens
depend only on its logits and its seed, never on what else is in the batch (batched reductions over
tensors of different widths may round differently, and one batch-wide generator would hand each row
different random numbers depending on its neighbours).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenfab.sampling import SamplingParams

# A top-p row (without top-k) looks for its nucleus among its best 64 tokens, then 1024, then all of
# them, checking the candidates' mass each time, so the result is always exact. A full sort of a 49k
# vocabulary costs about 6 ms per row on this CPU, top-64 about 0.1 ms and top-1024 about 0.7 ms.
_TOP_P_WIDTHS = (64, 1024)


@dataclass(slots=True)
class SampleRow:
    """One row of logits: one sequence's next token."""
    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]          # generated so far (for penalties and min_tokens)
    generator: torch.Generator | None    # seeded per request when params.seed is set, else None


@dataclass(slots=True)
class SampledToken:
    token_id: int
    logprob: float | None                      # of the chosen token under log_softmax(raw logits), when asked
    top_logprobs: dict[int, float] | None      # the params.logprobs most likely tokens -> logprob, when asked


def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """The per-request generator a seeded SampleRow carries."""
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g


def _plain_greedy(p: SamplingParams, num_output: int) -> bool:
    return (p.temperature < 1e-5 and p.logprobs is None and p.repetition_penalty == 1.0
            and p.presence_penalty == 0.0 and p.frequency_penalty == 0.0 and num_output >= p.min_tokens)


class Sampler:
    def __init__(self, eos_token_ids: list[int], vocab_size: int) -> None:
        self.eos_token_ids = list(eos_token_ids)
        self.vocab_size = vocab_size

    def __call__(self, logits: torch.Tensor, rows: list[SampleRow]) -> list[SampledToken]:
        assert logits.dim() == 2 and logits.shape[0] == len(rows), (tuple(logits.shape), len(rows))
        if logits.shape[1] > self.vocab_size:  # padded LM heads: padding ids are never valid tokens
            logits = logits[:, : self.vocab_size]
        if all(_plain_greedy(r.params, len(r.output_token_ids)) for r in rows):
            return [SampledToken(t, None, None) for t in logits.argmax(dim=-1).tolist()]

        logprob_rows = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
        raw_logprobs = torch.log_softmax(logits[logprob_rows], dim=-1) if logprob_rows else None

        logits = self.process_logits(logits, rows)
        token_ids = self._choose(logits, rows)

        out = [SampledToken(t, None, None) for t in token_ids]
        if raw_logprobs is not None:
            self._fill_logprobs(out, raw_logprobs, logprob_rows, rows)
        return out

    # ----------------------------------------------------------------------------------------------
    def process_logits(self, logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
        """min_tokens masking and penalties; returns a new tensor when anything changes.

        Temperature and truncation are not applied here: they belong to the draw (see `_draw`).
        """
        mask_rows, mask_toks = [], []
        for i, r in enumerate(rows):
            p = r.params
            if len(r.output_token_ids) < p.min_tokens:
                banned = set(p.stop_token_ids)
                if not p.ignore_eos:  # as vLLM: with ignore_eos, EOS is not a stop token, so not banned
                    banned.update(self.eos_token_ids)
                banned = [t for t in banned if t < logits.shape[1]]
                mask_rows += [i] * len(banned)
                mask_toks += banned
        pen = [i for i, r in enumerate(rows) if r.params.repetition_penalty != 1.0
               or r.params.presence_penalty != 0.0 or r.params.frequency_penalty != 0.0]
        if not mask_rows and not pen:
            return logits
        logits = logits.clone()
        if mask_rows:
            logits[torch.tensor(mask_rows), torch.tensor(mask_toks)] = float("-inf")
        if pen:
            logits[pen] = self._apply_penalties(logits[pen], [rows[i] for i in pen])
        return logits

    def _apply_penalties(self, x: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
        n, vocab = x.shape
        dev = x.device
        # Output token counts for all penalised rows, built by one scatter over the flattened ids.
        counts = torch.zeros(n, vocab, dtype=x.dtype, device=dev)
        lens = [len(r.output_token_ids) for r in rows]
        if sum(lens):
            flat = torch.tensor([t for r in rows for t in r.output_token_ids], device=dev)
            row_idx = torch.repeat_interleave(torch.arange(n, device=dev), torch.tensor(lens, device=dev))
            counts.index_put_((row_idx, flat), torch.ones_like(flat, dtype=x.dtype), accumulate=True)
        seen_out = counts > 0

        rep = torch.tensor([r.params.repetition_penalty for r in rows], dtype=x.dtype, device=dev)[:, None]
        rep_rows = [i for i, r in enumerate(rows) if r.params.repetition_penalty != 1.0]
        if rep_rows:
            # HF/vLLM repetition penalty: over prompt *and* output tokens, shrink positive logits by
            # dividing and push negative ones down by multiplying.
            seen = seen_out.clone()
            p_rows = [i for i in rep_rows for _ in rows[i].prompt_token_ids]
            if p_rows:
                p_toks = [t for i in rep_rows for t in rows[i].prompt_token_ids]
                seen[torch.tensor(p_rows, device=dev), torch.tensor(p_toks, device=dev)] = True
            penalised = torch.where(x > 0, x / rep, x * rep)
            x = torch.where(seen, penalised, x)

        # OpenAI frequency/presence penalties: over output tokens only.
        freq = torch.tensor([r.params.frequency_penalty for r in rows], dtype=x.dtype, device=dev)[:, None]
        pres = torch.tensor([r.params.presence_penalty for r in rows], dtype=x.dtype, device=dev)[:, None]
        return x - freq * counts - pres * seen_out.to(x.dtype)

    # ----------------------------------------------------------------------------------------------
    def _choose(self, logits: torch.Tensor, rows: list[SampleRow]) -> list[int]:
        greedy = [i for i, r in enumerate(rows) if r.params.greedy]
        seeded = [i for i, r in enumerate(rows) if not r.params.greedy and r.generator is not None]
        batched = [i for i, r in enumerate(rows) if not r.params.greedy and r.generator is None]
        token_ids = [0] * len(rows)
        if greedy:
            picked = logits[greedy].argmax(dim=-1).tolist() if len(greedy) < len(rows) else logits.argmax(dim=-1).tolist()
            for i, t in zip(greedy, picked):
                token_ids[i] = t
        if batched:
            picked = _draw(logits[batched], [rows[i].params for i in batched], None)
            for i, t in zip(batched, picked):
                token_ids[i] = t
        for i in seeded:
            token_ids[i] = _draw(logits[i : i + 1], [rows[i].params], rows[i].generator)[0]
        return token_ids

    @staticmethod
    def _fill_logprobs(out: list[SampledToken], raw: torch.Tensor, which: list[int], rows: list[SampleRow]) -> None:
        chosen = torch.tensor([out[i].token_id for i in which], device=raw.device)
        chosen_lp = raw.gather(1, chosen[:, None])[:, 0].tolist()
        k = max(rows[i].params.logprobs for i in which)
        top_v, top_i = raw.topk(k, dim=-1) if k > 0 else (raw[:, :0], raw[:, :0].long())
        top_v, top_i = top_v.tolist(), top_i.tolist()
        for j, i in enumerate(which):
            n = rows[i].params.logprobs
            out[i].logprob = chosen_lp[j]
            out[i].top_logprobs = {top_i[j][m]: top_v[j][m] for m in range(n)}


def _draw(x: torch.Tensor, params: list[SamplingParams], generator: torch.Generator | None) -> list[int]:
    """Temperature, min-p, top-k, top-p, then one draw per row."""
    n, vocab = x.shape
    dev = x.device
    x = x / torch.tensor([p.temperature for p in params], dtype=x.dtype, device=dev)[:, None]
    if any(p.min_p > 0 for p in params):
        # Keep tokens whose probability is at least min_p times the most likely token's.
        min_p = torch.tensor([p.min_p for p in params], dtype=x.dtype, device=dev)[:, None]
        probs = torch.softmax(x, dim=-1)
        x = x.masked_fill(probs < min_p * probs.amax(dim=-1, keepdim=True), float("-inf"))

    top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    top_p = [p.top_p for p in params]
    plain = [i for i in range(n) if top_k[i] == vocab and top_p[i] >= 1.0]
    with_k = [i for i in range(n) if top_k[i] < vocab]
    p_only = [i for i in range(n) if top_k[i] == vocab and top_p[i] < 1.0]
    out = [0] * n

    def put(rows: list[int], tokens: list[int]) -> None:
        for i, t in zip(rows, tokens):
            out[i] = t

    if plain:
        put(plain, _inverse_cdf(torch.softmax(x[plain], dim=-1), generator).tolist())
    if with_k:
        # The nucleus of a top-k row lies inside its k best tokens, renormalised over them.
        xs = x[with_k]
        vals, idx = _sorted_top(xs, max(top_k[i] for i in with_k))
        put(with_k, _truncated_draw(vals, idx, torch.logsumexp(vals, dim=-1, keepdim=True),
                                    [top_k[i] for i in with_k], [top_p[i] for i in with_k], generator))
    for width in [w for w in _TOP_P_WIDTHS if w < vocab] + [vocab]:
        if not p_only:
            break
        xs = x[p_only]
        vals, idx = _sorted_top(xs, width)
        lse = torch.logsumexp(xs, dim=-1, keepdim=True)
        if width < vocab:
            # Rows whose best `width` tokens hold less mass than top_p retry with a wider window.
            mass = torch.exp(torch.logsumexp(vals, dim=-1, keepdim=True) - lse)[:, 0].tolist()
            ok = [j for j, i in enumerate(p_only) if mass[j] >= top_p[i]]
        else:
            ok = list(range(len(p_only)))
        if ok:
            rows = [p_only[j] for j in ok]
            put(rows, _truncated_draw(vals[ok], idx[ok], lse[ok], [vocab] * len(rows), [top_p[i] for i in rows], generator))
            p_only = [i for i in p_only if i not in set(rows)]
    return out


def _truncated_draw(vals: torch.Tensor, idx: torch.Tensor, lse: torch.Tensor, top_k: list[int],
                    top_p: list[float], generator: torch.Generator | None) -> list[int]:
    """Draw from sorted candidates `vals` (token ids `idx`) after top-k and top-p.

    `lse` is the log normaliser the nucleus is measured against: the top-k set's for top-k rows, the
    whole vocabulary's otherwise (candidates beyond the window still carry mass).
    """
    width = vals.shape[1]
    pos = torch.arange(width, device=vals.device)[None, :]
    vals = vals.masked_fill(pos >= torch.tensor(top_k, device=vals.device)[:, None], float("-inf"))
    if any(p < 1.0 for p in top_p):
        probs = torch.exp(vals - lse)
        mass_before = torch.cumsum(probs, dim=-1) - probs
        p_t = torch.tensor(top_p, dtype=vals.dtype, device=vals.device)[:, None]
        # Keep a token while the mass strictly before it is below top_p; the best token always stays.
        vals = vals.masked_fill((mass_before >= p_t) & (pos > 0), float("-inf"))
    choice = _inverse_cdf(torch.softmax(vals, dim=-1), generator)
    return idx.gather(1, choice[:, None])[:, 0].tolist()


def _inverse_cdf(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One index per row, drawn with probability proportional to `probs` (rows of weights >= 0).

    One uniform number per row and a binary search over the running sum: about 0.1 ms for a 49k row,
    where torch.multinomial takes about 2 ms on this CPU.
    """
    cdf = probs.cumsum(dim=-1)
    total = cdf[:, -1:].contiguous()
    u = torch.rand(total.shape, generator=generator, dtype=cdf.dtype, device=cdf.device) * total
    # right=True: the first index whose running sum exceeds u, so zero-weight tokens are never chosen.
    idx = torch.searchsorted(cdf, u, right=True)
    # u may round up to the total itself; then take the last token with weight.
    last = torch.searchsorted(cdf, total, right=False)
    return torch.minimum(idx, last)[:, 0]


def _sorted_top(x: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    if width >= x.shape[1]:
        return torch.sort(x, dim=-1, descending=True, stable=True)
    return torch.topk(x, width, dim=-1, sorted=True)

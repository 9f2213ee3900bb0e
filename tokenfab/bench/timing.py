"""One request's metrics from its timed chunks: TTFT, ITL, TPOT and E2E, as vLLM defines them.

- TTFT: sent → the first chunk that carries content.
- E2E: sent → the last chunk that carries a token.
- ITL: the gaps between successive tokens. A chunk of n tokens that arrives g after the previous
  one contributes n gaps of g/n; extra tokens in the first chunk contribute gaps of 0. So a
  request's ITLs number (output tokens − 1) and sum to E2E − TTFT.
- TPOT: (E2E − TTFT) / (output tokens − 1), for requests with more than one output token.

Tokens per chunk come from the server (usage deltas or logprobs). When it only gave a total,
or nothing at all, that total (or the tokenizer's count of the whole output) is spread over
the chunks by their text; see `resolve_counts`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from tokenfab.bench.client import RawResult
from tokenfab.bench.datasets import BenchRequest
from tokenfab.bench.tokens import TokenCounter


@dataclass(slots=True)
class RequestRecord:
    """One request as it appears in the JSON output. Times in ms unless named _s."""
    index: int
    tag: str
    prompt_len: int
    max_tokens: int
    success: bool
    error: str | None
    scheduled_s: float            # when it was due, from the start of the run
    sent_s: float                 # when it went out
    end_s: float                  # when its stream closed (or it failed)
    send_lag_ms: float            # sent − scheduled: client lag plus any wait for a concurrency slot
    slot_wait_ms: float           # the part of that lag spent waiting under --max-concurrency
    output_len: int = 0
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2el_ms: float | None = None
    itl_ms: list[float] = field(default_factory=list)
    chunks: int = 0
    token_count_source: str | None = None   # usage | logprobs | final_usage | tokenizer | approximate
    server_prompt_tokens: int | None = None
    finish_reason: str | None = None


def apportion(total: int, weights: list[float]) -> list[int]:
    """Split `total` tokens over chunks: at least one each while there are enough, the rest by
    weight (largest remainder), so the counts always add up to `total` exactly."""
    n = len(weights)
    if n == 0 or total <= 0:
        return [0] * n
    if total >= n:
        base, extra, w = [1] * n, total - n, [max(x - 1.0, 0.0) for x in weights]
    else:
        base, extra, w = [0] * n, total, [max(x, 0.0) for x in weights]
    if sum(w) <= 0:
        w = [1.0] * n
    share = [extra * x / sum(w) for x in w]
    counts = [b + int(s) for b, s in zip(base, share)]
    order = sorted(range(n), key=lambda i: (-(share[i] - int(share[i])), i))
    for i in order[:total - sum(counts)]:
        counts[i] += 1
    if counts[0] == 0:  # the first content chunk brings the first token
        j = max(range(n), key=lambda i: counts[i])
        counts[j] -= 1
        counts[0] += 1
    return counts


def resolve_counts(raw: RawResult, counter: TokenCounter) -> tuple[list[int], str]:
    """Tokens per chunk, and where the numbers came from."""
    events = raw.events
    known = [e.tokens for e in events]
    final = raw.completion_tokens
    if all(k is not None for k in known):
        counts = list(known)
        if final is not None and final > sum(counts) and counts:
            counts[-1] += final - sum(counts)  # tokens whose chunks carried no count arrived by the end
        return counts, raw.count_source or "usage"
    if final is not None:
        total, source = final, "final_usage" if not any(k is not None for k in known) else raw.count_source
    else:
        total = counter.count_text(["".join(e.text for e in events)])[0]
        source = "tokenizer" if counter.exact else "approximate"
    unknown = [i for i, k in enumerate(known) if k is None]
    rest = max(total - sum(k for k in known if k is not None), 0)
    weights = counter.count_text([events[i].text for i in unknown])
    counts = [k or 0 for k in known]
    for i, c in zip(unknown, apportion(rest, weights)):
        counts[i] = c
    return counts, source


def request_record(index: int, req: BenchRequest, raw: RawResult, scheduled: float, slot_at: float,
                   t0: float, counter: TokenCounter) -> RequestRecord:
    """`scheduled`, `slot_at` (a concurrency slot was free), `t0` (run start): perf_counter values."""
    rec = RequestRecord(index=index, tag=req.tag, prompt_len=req.prompt_len, max_tokens=req.output_len,
                        success=raw.error is None, error=raw.error,
                        scheduled_s=scheduled - t0, sent_s=raw.sent - t0, end_s=raw.end - t0,
                        send_lag_ms=(raw.sent - scheduled) * 1e3,
                        slot_wait_ms=max(slot_at - scheduled, 0.0) * 1e3,
                        chunks=len(raw.events), server_prompt_tokens=raw.prompt_tokens,
                        finish_reason=raw.finish_reason)
    if not rec.success:
        return rec
    counts, rec.token_count_source = resolve_counts(raw, counter)
    rec.output_len = sum(counts)
    timed = [(e.t, c) for e, c in zip(raw.events, counts) if c > 0]
    rec.ttft_ms = raw.events[0].t * 1e3
    rec.e2el_ms = (timed[-1][0] if timed else raw.events[-1].t) * 1e3
    rec.itl_ms = itls_ms(raw.events[0].t, timed)
    if rec.output_len > 1:
        rec.tpot_ms = (rec.e2el_ms - rec.ttft_ms) / (rec.output_len - 1)
    return rec


def itls_ms(first_t: float, timed: list[tuple[float, int]]) -> list[float]:
    """Per-token gaps from (arrival time, tokens) of the chunks that carried tokens."""
    out: list[float] = []
    last = first_t
    for k, (t, n) in enumerate(timed):
        if k == 0:
            out += [0.0] * (n - 1)  # arrived together with the first token
        else:
            out += [(t - last) * 1e3 / n] * n
        last = t
    return out

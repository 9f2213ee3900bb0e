"""`bench offline`: prefill and decode throughput of the in-process engine, without HTTP.

For each batch size B, two timed `LLM.generate` calls on fresh random prompts of exactly
`input_len` tokens (fresh, so the second call gets no prefix-cache hits from the first):
- a max_tokens=1 run: prefill tok/s = prompt tokens / its time;
- a max_tokens=output_len run: decode tok/s = (output tokens − B) / (its time − the prefill
  run's time), i.e. the tokens after each sequence's first, over the time beyond prefill.
Both use greedy sampling with ignore_eos, so every sequence produces exactly what was asked.
"""
from __future__ import annotations

import datetime
import random
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from tokenfab.bench.schema import OFFLINE_SCHEMA, SCHEMA_VERSION


@dataclass(slots=True)
class OfflineConfig:
    model: str | None = None              # None: the bundled model
    batch_sizes: list[int] = field(default_factory=lambda: [1, 4, 16])
    input_len: int = 128
    output_len: int = 128
    max_num_seqs: int | None = None       # default: the largest batch size
    max_num_batched_tokens: int | None = None
    seed: int = 0
    warmup: bool = True


@dataclass(slots=True)
class OfflineRun:
    batch_size: int
    prompt_tokens: int
    output_tokens: int
    prefill_s: float
    total_s: float
    prefill_tok_s: float | None
    decode_tok_s: float | None
    decode_tok_s_per_seq: float | None
    total_tok_s: float | None


def random_prompts(vocab_ids: list[int], n: int, length: int, rng: random.Random) -> list[list[int]]:
    return [rng.choices(vocab_ids, k=length) for _ in range(n)]


def prompt_vocab(tokenizer) -> list[int]:
    """Ids of ordinary single-token words (" river") of the model's vocabulary: no special tokens."""
    from tokenfab.bench.tokens import TokenCounter
    words = TokenCounter(tokenizer).words()[:4096]
    ids = {tuple(tokenizer(w, add_special_tokens=False)["input_ids"]) for w in words}
    return sorted(i[0] for i in ids if len(i) == 1)


def measure_batch(llm, sampling_params: Callable[..., object], vocab_ids: list[int], batch: int, input_len: int,
                  output_len: int, rng: random.Random, clock: Callable[[], float] = time.perf_counter) -> OfflineRun:
    prefill_prompts = random_prompts(vocab_ids, batch, input_len, rng)
    t = clock()
    outs = llm.generate(prefill_prompts, sampling_params(max_tokens=1, temperature=0.0, ignore_eos=True),
                        use_tqdm=False)
    prefill_s = clock() - t
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outs)

    full_prompts = random_prompts(vocab_ids, batch, input_len, rng)
    t = clock()
    outs = llm.generate(full_prompts, sampling_params(max_tokens=output_len, temperature=0.0, ignore_eos=True),
                        use_tqdm=False)
    total_s = clock() - t
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    full_prompt_tokens = sum(len(o.prompt_token_ids) for o in outs)

    decode_s = total_s - prefill_s
    decode_tokens = out_tokens - len(outs)
    decode = decode_tokens / decode_s if decode_s > 0 and decode_tokens > 0 else None
    return OfflineRun(batch_size=batch, prompt_tokens=prompt_tokens, output_tokens=out_tokens,
                      prefill_s=prefill_s, total_s=total_s,
                      prefill_tok_s=prompt_tokens / prefill_s if prefill_s > 0 else None,
                      decode_tok_s=decode, decode_tok_s_per_seq=decode / batch if decode else None,
                      total_tok_s=(full_prompt_tokens + out_tokens) / total_s if total_s > 0 else None)


def run_offline(cfg: OfflineConfig, llm=None, sampling_params=None, vocab_ids: list[int] | None = None,
                clock: Callable[[], float] = time.perf_counter, on_run: Callable[[OfflineRun], None] | None = None) -> dict:
    """Measure every batch size; `llm`, `sampling_params`, `vocab_ids` and `clock` can be injected (tests)."""
    if cfg.input_len < 1 or cfg.output_len < 2:
        raise ValueError(f"need input_len >= 1 and output_len >= 2 (decode is measured beyond the first token); "
                         f"got {cfg.input_len} and {cfg.output_len}")
    if not cfg.batch_sizes or min(cfg.batch_sizes) < 1:
        raise ValueError(f"batch sizes {cfg.batch_sizes} must be positive integers")
    if llm is None or sampling_params is None:
        from tokenfab.llm import LLM
        from tokenfab.sampling import SamplingParams
        kwargs = {"max_num_seqs": cfg.max_num_seqs or max(cfg.batch_sizes),
                  "max_num_batched_tokens": cfg.max_num_batched_tokens}
        llm = llm or LLM(model=cfg.model, **{k: v for k, v in kwargs.items() if v is not None})
        sampling_params = sampling_params or SamplingParams
    vocab_ids = vocab_ids or prompt_vocab(llm.get_tokenizer())
    rng = random.Random(cfg.seed)
    if cfg.warmup:  # first calls pay for lazy initialisation and allocator growth
        llm.generate(random_prompts(vocab_ids, 2, min(cfg.input_len, 16), rng),
                     sampling_params(max_tokens=2, temperature=0.0, ignore_eos=True), use_tqdm=False)
    runs = []
    for b in cfg.batch_sizes:
        run = measure_batch(llm, sampling_params, vocab_ids, b, cfg.input_len, cfg.output_len, rng, clock)
        runs.append(run)
        if on_run:
            on_run(run)
    from tokenfab.version import __version__
    return {"schema": OFFLINE_SCHEMA, "schema_version": SCHEMA_VERSION, "tokenfab_version": __version__,
            "created_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": " ".join(sys.argv) if sys.argv and sys.argv[0] else None,
            "config": asdict(cfg), "runs": [asdict(r) for r in runs]}

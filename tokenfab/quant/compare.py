"""`tokenfab quant eval`: a candidate model against its full-precision base, on token windows of text.

Both models run the engine's decoder through `full_logits` (every position of a window) over the
same windows; the per-token statistics of all windows are pooled into one `QualityReport`
(eval.py). Every position of a window but its last is scored, each from the window's earlier tokens.

The candidate is one of:
- a scheme name (`int8`, `int4-g32`, `awq-int4-g128`, ...): the base's float weights quantized now
  (AWQ calibrates on the bundled text's calibration slice, disjoint from the evaluation windows);
- `gguf`: the base GGUF file's blocks run as shipped;
- `none`: the base's float weights again (with `kv_cache_dtype="int8"`: the int8 KV cache alone);
- a model path, e.g. a folder written by `tokenfab quant`: loaded as the engine would load it.

`kv_cache_dtype="int8"` runs the candidate's attention over the int8 KV cache (attention.py), so its
cost shows on its own (candidate `none`) or on top of a weight scheme.

`speed_tokens` > 0 adds both models' single-stream greedy decode speed (speed.py), timed alternately
in the same run, so a pruned or quantized candidate's tokens/s stands beside its KL.

`kernel`: the quantized layers' path. "auto" picks per call by token count, and a window of 512
tokens is many tokens: it dequantizes, so the numbers are the weights' error alone. "packed" forces
the CPU kernels that decode steps use (bfloat16 activations), adding their rounding.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from tokenfab.quant.eval import QualityReport, TokenStats, next_token_targets, summarize, token_stats
from tokenfab.quant.linear import set_kernel
from tokenfab.quant.schemes import ALIASES, SCHEMES, parse_scheme

GGUF_CANDIDATE = "gguf"
FLOAT_CANDIDATE = "none"
DEFAULT_CTX = 512
DEFAULT_MAX_WINDOWS = 2       # ~1,000 scored tokens: a short default run; raise it for tighter error bars
SPEED_PROMPT_TOKENS = 32      # the decode-speed prompt: the first tokens of the first window


def candidate_kind(candidate: str) -> str:
    """"scheme", "gguf", "float" or "path" (anything else must exist on disk; the loader says so if not)."""
    if candidate == GGUF_CANDIDATE:
        return "gguf"
    if candidate == FLOAT_CANDIDATE:
        return "float"
    if candidate in SCHEMES or candidate in ALIASES:
        return "scheme"
    return "path"


@dataclass
class SensitivityRow:
    name: str
    kl_mean: float
    kl_max: float
    same_top1_pct: float


@dataclass
class DecodeSpeed:
    """Single-stream greedy decode tokens/s of both models, timed alternately in one run (speed.py)."""
    tokens: int
    base_tokens_per_s: float
    candidate_tokens_per_s: float
    speedup: float


def measure_speeds(base_model, cand_model, prompt: list[int], tokens: int, rounds: int = 2) -> DecodeSpeed:
    """The best of `rounds` alternating timings of each model (a busy machine slows single runs)."""
    from tokenfab.quant.speed import decode_speed
    base, cand = 0.0, 0.0
    for _ in range(rounds):
        base = max(base, decode_speed(base_model, prompt, tokens)[0])
        cand = max(cand, decode_speed(cand_model, prompt, tokens)[0])
    return DecodeSpeed(tokens, round(base, 2), round(cand, 2), round(cand / base, 3))


@dataclass
class EvalResult:
    base: str
    candidate: str
    kv_cache_dtype: str
    kernel: str
    ctx: int
    windows: int
    report: QualityReport
    stats: TokenStats = field(repr=False)
    seconds: float = 0.0
    sensitivity: list[SensitivityRow] | None = None
    sensitivity_scheme: str | None = None
    speed: DecodeSpeed | None = None

    def as_dict(self) -> dict:
        d = {"base": self.base, "candidate": self.candidate, "kv_cache_dtype": self.kv_cache_dtype,
             "kernel": self.kernel, "ctx": self.ctx, "windows": self.windows,
             "seconds": round(self.seconds, 2), **self.report.as_dict()}
        if self.speed is not None:
            d["decode_speed"] = vars(self.speed)
        if self.sensitivity is not None:
            d["sensitivity"] = {"scheme": self.sensitivity_scheme,
                                "rows": [vars(r) for r in self.sensitivity]}
        return d


def _scheme_for_sensitivity(candidate: str, kind: str) -> str:
    if kind == "scheme":
        return parse_scheme(candidate).name
    if kind == "path":
        from tokenfab.quant.checkpoint import is_quantized_checkpoint, read_quant_config
        scheme = read_quant_config(candidate).get("scheme") if is_quantized_checkpoint(candidate) else None
        if scheme:
            return scheme
    raise ValueError(f"--sensitivity quantizes one layer at a time with a scheme; candidate {candidate!r} "
                     "names none (use a scheme such as int4-g32, or a folder written by `tokenfab quant`)")


def build_candidate(base_files, candidate: str, max_positions: int, calib_windows: Callable[[], list[list[int]]],
                    keep_float: list[str] | None = None):
    """The candidate model (float32 compute, CPU) for `candidate` (see the module docstring)."""
    from tokenfab.quant.export import build_float_model, forward_windows

    kind = candidate_kind(candidate)
    if kind in ("gguf", "float"):
        return build_float_model(base_files, max_positions, "gguf" if kind == "gguf" else "none")
    if kind == "scheme":
        from tokenfab.quant.apply import quantize_model
        spec = parse_scheme(candidate)
        model = build_float_model(base_files, max_positions, "none")
        quantize_model(model, spec.name, keep_float, forward_windows(calib_windows()) if spec.awq else None)
        return model
    from tokenfab.model.loader import load_model_files
    files = load_model_files(candidate)
    if files.config.vocab_size != base_files.config.vocab_size:
        raise ValueError(f"candidate {candidate} has a vocabulary of {files.config.vocab_size} tokens, the base "
                         f"{base_files.config.vocab_size}; KL needs the same vocabulary")
    return build_float_model(files, max_positions, "auto")


def evaluate(base: str | None, candidate: str, *, text: str | None = None, ctx: int = DEFAULT_CTX,
             max_windows: int | None = DEFAULT_MAX_WINDOWS, sensitivity: bool = False, sensitivity_by: str = "block",
             keep_float: list[str] | None = None, kv_cache_dtype: str = "auto", kernel: str = "auto", base_files=None,
             speed_tokens: int = 0, progress: Callable[[str], None] | None = None) -> EvalResult:
    """Run the comparison. `base_files`: the base's files already read (tests reuse one read).
    `speed_tokens` > 0: also time both models' greedy decode of that many tokens (speed.py)."""
    from tokenfab.model.llama import full_logits
    from tokenfab.model.loader import load_model_files
    from tokenfab.quant.export import build_float_model, calibration_windows
    from tokenfab.quant.text import split_eval_calib, text_token_ids, token_windows

    if kv_cache_dtype not in ("auto", "int8"):
        raise ValueError(f"kv_cache_dtype must be auto or int8, got {kv_cache_dtype!r}")
    say = progress or (lambda _msg: None)
    t0 = time.perf_counter()
    kind = candidate_kind(candidate)
    sens_scheme = _scheme_for_sensitivity(candidate, kind) if sensitivity else None
    files = base_files or load_model_files(base)
    ids = text_token_ids(files.tokenizer, text)
    if text is None:
        ids = split_eval_calib(ids)[0]      # the calibration slice stays unseen by evaluation
    windows = token_windows(ids, ctx, max_windows)
    say(f"base {files.path} (float), {len(windows)} windows of {ctx} tokens")
    positions = max(ctx, SPEED_PROMPT_TOKENS + speed_tokens) + 1
    base_model = build_float_model(files, positions, "none")

    def calib() -> list[list[int]]:
        return calibration_windows(files.tokenizer, None, 1024)

    say(f"candidate {candidate}")
    cand_model = build_candidate(files, candidate, positions, calib, keep_float)
    set_kernel(cand_model, kernel)
    parts: list[TokenStats] = []
    first_base_logits = None
    for i, w in enumerate(windows):     # one window's logits at a time: [ctx, vocab] float32 each
        say(f"window {i + 1}/{len(windows)}")
        bl = full_logits(base_model, w)
        first_base_logits = bl if i == 0 else first_base_logits
        rows, targets = next_token_targets(torch.tensor(w))
        cl = full_logits_int8_kv(cand_model, w) if kv_cache_dtype == "int8" else full_logits(cand_model, w)
        parts.append(token_stats(bl[rows], cl[rows], targets))
    speed = None
    if speed_tokens:
        say(f"decode speed, {speed_tokens} tokens each")
        speed = measure_speeds(base_model, cand_model, windows[0][:SPEED_PROMPT_TOKENS], speed_tokens)
    del cand_model
    stats = TokenStats(*(torch.cat([getattr(p, f) for p in parts]) for f in TokenStats.__dataclass_fields__))
    result = EvalResult(files.path if base is None else base, candidate, kv_cache_dtype, kernel, ctx, len(windows),
                        summarize(stats), stats, speed=speed)

    if sensitivity:
        result.sensitivity_scheme = sens_scheme
        result.sensitivity = layer_table(base_model, windows[0], first_base_logits, sens_scheme, sensitivity_by,
                                         calib if parse_scheme(sens_scheme).awq else None, say)
    result.seconds = time.perf_counter() - t0
    return result


def layer_table(model, window: list[int], base_logits: torch.Tensor, scheme: str, by: str,
                calib: Callable[[], list[list[int]]] | None, say: Callable[[str], None]) -> list[SensitivityRow]:
    """KL on one window when only one group of linears (a decoder block by default) is quantized."""
    from tokenfab.model.llama import full_logits
    from tokenfab.quant.apply import DEFAULT_KEEP_FLOAT, linear_names, name_matches
    from tokenfab.quant.awq import collect_activations
    from tokenfab.quant.export import forward_windows
    from tokenfab.quant.sensitivity import group_names, layer_sensitivity

    names = [n for n in linear_names(model) if not any(name_matches(n, p) for p in DEFAULT_KEEP_FLOAT)]
    stats = collect_activations(model, names, forward_windows(calib())) if calib else None
    rows = layer_sensitivity(model, lambda m: full_logits(m, window), scheme, groups=group_names(names, by),
                             base_logits=base_logits, calib_stats=stats, progress=lambda m: say(f"sensitivity {m}"))
    return [SensitivityRow(r.name, r.kl_mean, r.kl_max, r.same_top1_pct) for r in rows]


@torch.inference_mode()
def full_logits_int8_kv(model, token_ids: list[int], block_size: int = 16) -> torch.Tensor:
    """As `llama.full_logits`, with the attention reading an int8 KV cache (one prefill chunk; the
    new tokens' K/V are attended to as stored, so this equals chunk-by-chunk serving)."""
    from tokenfab.model.attention import AttentionMetadata, Int8KVCache, PrefillChunk

    cfg = model.config
    dev, dtype = model.embed_tokens.weight.device, model.embed_tokens.weight.dtype
    T = len(token_ids)
    nblocks = -(-T // block_size)
    data = torch.zeros(cfg.num_layers, 2, nblocks, block_size, cfg.num_kv_heads, cfg.head_dim,
                       dtype=torch.int8, device=dev)
    scales = torch.zeros(data.shape[:-1], dtype=torch.float32, device=dev)
    caches = [tuple(Int8KVCache(data[i, j], scales[i, j], dtype) for j in (0, 1)) for i in range(cfg.num_layers)]
    meta = AttentionMetadata(slot_mapping=torch.arange(T, device=dev), num_decode_tokens=0,
                             decode_block_tables=None, decode_context_lens=None, decode_max_context=0,
                             prefills=[PrefillChunk(0, T, T, torch.arange(nblocks, device=dev))])
    positions = torch.arange(T, device=dev)
    return model(torch.tensor(token_ids, device=dev), positions, caches, meta, positions)

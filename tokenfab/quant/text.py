"""The bundled evaluation text (human-written English in tokenfab/quant/data, see its README), and
the token windows that evaluation and calibration take from it.

Evaluation and calibration must not see the same tokens, or AWQ would be graded on its own
calibration set. The bundled text is therefore split once, by tokens: evaluation windows come from
the first `EVAL_FRACTION` of it, calibration windows from the rest (`split_eval_calib`).
"""
from __future__ import annotations

import os

DATA_DIR = os.path.join(os.path.dirname(__file__), "data")
EVAL_TEXT_FILES = ("GPL-3.txt", "GPL-2.txt", "LGPL-2.1.txt", "GFDL-1.3.txt")
EVAL_FRACTION = 0.75     # of the bundled text's tokens; the last quarter is the calibration slice


def eval_text_paths() -> list[str]:
    return [os.path.join(DATA_DIR, f) for f in EVAL_TEXT_FILES]


def load_eval_text(path: str | None = None, max_chars: int | None = None) -> str:
    """`path`'s text, or the bundled files joined by blank lines; optionally cut to `max_chars`."""
    if path is not None:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    else:
        parts = []
        for p in eval_text_paths():
            with open(p, encoding="utf-8") as f:
                parts.append(f.read().strip())
        text = "\n\n".join(parts)
    if not text.strip():
        raise ValueError(f"evaluation text {path or DATA_DIR} is empty")
    return text if max_chars is None else text[:max_chars]


def split_eval_calib(token_ids: list[int]) -> tuple[list[int], list[int]]:
    """(evaluation tokens, calibration tokens): disjoint slices of one text, evaluation first."""
    cut = int(len(token_ids) * EVAL_FRACTION)
    return token_ids[:cut], token_ids[cut:]


def token_windows(token_ids: list[int], ctx: int, max_windows: int | None = None) -> list[list[int]]:
    """Consecutive non-overlapping windows of `ctx` tokens (a shorter tail is dropped, as llama.cpp's
    perplexity tool does), at most `max_windows` of them (None or 0: all)."""
    if ctx < 2:
        raise ValueError(f"context must be at least 2 tokens (one to predict from, one to predict), got {ctx}")
    n = len(token_ids) // ctx
    if n == 0:
        raise ValueError(f"the text has {len(token_ids)} tokens, fewer than one window of {ctx}; "
                         "use a longer text or a smaller --ctx")
    if max_windows:
        n = min(n, max_windows)
    return [token_ids[i * ctx:(i + 1) * ctx] for i in range(n)]


def text_token_ids(tokenizer, path: str | None = None) -> list[int]:
    """The text tokenized whole, without special tokens (windows start mid-text anyway)."""
    return list(tokenizer(load_eval_text(path), add_special_tokens=False).input_ids)

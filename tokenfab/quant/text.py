"""The bundled evaluation text: human-written English shipped in tokenfab/quant/data (see its README)."""
from __future__ import annotations

import os

DATA_DIR = os.path.join(os.path.dirname(__file__), "data")
EVAL_TEXT_FILES = ("GPL-3.txt", "GPL-2.txt", "LGPL-2.1.txt", "GFDL-1.3.txt")


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

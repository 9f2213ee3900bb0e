"""Tokenizer and chat template, from a GGUF's metadata or an HF folder, through `transformers`.

Converting a GGUF vocabulary takes seconds (about 8 s for SmolLM2 on this machine), so the
converted tokenizer is saved once under ~/.cache/tokenfab/tokenizers, keyed by the file's
identity (path, size, mtime), and loaded from there afterwards.
"""
from __future__ import annotations

import hashlib
import logging
import os

_CACHE_DIR = os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "tokenfab", "tokenizers")


def _cache_key(path: str) -> str:
    st = os.stat(path)
    return hashlib.sha256(f"{os.path.abspath(path)}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:24]


def load_tokenizer(path: str):
    """A `transformers` fast tokenizer for a .gguf file or an HF folder."""
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    if os.path.isdir(path):
        return AutoTokenizer.from_pretrained(path)
    cached = os.path.join(_CACHE_DIR, _cache_key(path))
    if os.path.isfile(os.path.join(cached, "tokenizer.json")):
        try:
            return AutoTokenizer.from_pretrained(cached)
        except Exception:  # a damaged cache entry: rebuild it below
            logging.getLogger(__name__).warning("tokenizer cache %s unreadable; rebuilding", cached)
    tok = AutoTokenizer.from_pretrained(os.path.dirname(path) or ".", gguf_file=os.path.basename(path))
    try:
        os.makedirs(cached, exist_ok=True)
        tok.save_pretrained(cached)
    except OSError:
        pass  # a read-only home only costs the conversion time next start
    return tok

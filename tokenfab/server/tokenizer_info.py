"""GET /tokenizer_info: the tokenizer's configuration, as vLLM serves it (what tokenizer_config.json holds).

lm-eval's remote tokenizer (`tokenizer_backend=remote`, chosen automatically when this route answers)
reads `eos_token`, `bos_token`, `pad_token` and `chat_template` from it, then tokenizes through
/tokenize and /detokenize, so evaluating against this server needs no tokenizer download.

As vLLM does: the tokenizer's init kwargs with special tokens as plain strings, `tokenizer_class`,
and `chat_template`, without `added_tokens_decoder`. Unlike vLLM, local file paths (`name_or_path`,
`vocab_file`, ...) stay private, and `model_max_length` is the server's max_model_len (a tokenizer
without a limit says 1e30 there).
"""
from __future__ import annotations

from typing import Any

_PRIVATE = {"name_or_path", "vocab_file", "merges_file", "tokenizer_file", "tokenizer_object", "is_local",
            "local_files_only", "backend", "added_tokens_decoder", "cache_dir"}


def tokenizer_info(tokenizer, max_model_len: int) -> dict[str, Any]:
    config = {k: v for k, v in (getattr(tokenizer, "init_kwargs", None) or {}).items() if k not in _PRIVATE}
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        config[name] = getattr(tokenizer, name, None)      # resolved values, whatever the file said
    config["tokenizer_class"] = type(tokenizer).__name__
    config["chat_template"] = getattr(tokenizer, "chat_template", None)
    config["model_max_length"] = max_model_len
    return _json(config)


def _json(obj):
    if hasattr(obj, "content") and not isinstance(obj, (str, dict)):   # tokenizers.AddedToken
        return obj.content
    if isinstance(obj, dict):
        return {str(k): _json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json(v) for v in obj]
    if isinstance(obj, float) and obj != obj or obj in (float("inf"), float("-inf")):
        return str(obj)                     # JSON has no NaN or infinity
    if obj is None or isinstance(obj, (str, bool, int, float)):
        return obj
    return str(obj)

"""Logprobs in OpenAI's two formats, from the engine's per-token ``{token_id: Logprob}`` entries.

- Completions (legacy): ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``.
- Chat: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}``.

A token's text is its own bytes. Byte-level BPE tokens can hold part of a UTF-8 character; such a
token is shown as OpenAI shows it, ``"bytes:\\xe2\\x80"``, and its exact bytes go in ``bytes``.
"""
from __future__ import annotations

import re

from tokenfab.outputs import Logprob

_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet reversed: printable bytes stand for themselves and the other
    byte values are shifted to code points from 256 up, in order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping, shift = {}, 0
    for b in range(256):
        if b in printable:
            mapping[chr(b)] = b
        else:
            mapping[chr(256 + shift)] = b
            shift += 1
    return mapping


class TokenText:
    """Text and bytes of single tokens, cached by id."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        decoder = getattr(backend, "decoder", None)
        self._byte_level = _byte_level_alphabet() if "ByteLevel" in repr(decoder) else None
        self._special = set(getattr(tokenizer, "all_special_ids", []) or [])
        self._cache: dict[int, tuple[str, bytes]] = {}

    def _compute(self, token_id: int) -> tuple[str, bytes]:
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if piece is None:
            raw = b""
        elif token_id in self._special:
            raw = piece.encode()
        elif self._byte_level is not None and all(c in self._byte_level for c in piece):
            raw = bytes(self._byte_level[c] for c in piece)
        elif m := _BYTE_FALLBACK.fullmatch(piece):
            raw = bytes([int(m.group(1), 16)])
        else:
            raw = self.tokenizer.decode([token_id]).encode()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            text = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
        return text, raw

    def get(self, token_id: int) -> tuple[str, bytes]:
        hit = self._cache.get(token_id)
        if hit is None:
            hit = self._cache[token_id] = self._compute(token_id)
        return hit

    def text(self, token_id: int) -> str:
        return self.get(token_id)[0]


def _top(entry: dict[int, Logprob], n: int) -> list[tuple[int, float]]:
    return sorted(((t, lp.logprob) for t, lp in entry.items()), key=lambda x: -x[1])[:n]


def completion_logprobs(tt: TokenText, token_ids: list[int], entries: list[dict[int, Logprob]], top_n: int,
                        text_offset: int) -> tuple[dict, int]:
    """Legacy completions format for these tokens, and the text offset after them.

    As vLLM does, each `top_logprobs` entry holds the top `top_n` plus the chosen token. An entry of
    None (the first prompt token under `echo`, which nothing predicts) gives null logprobs."""
    tokens, token_lps, tops, offsets = [], [], [], []
    for tid, entry in zip(token_ids, entries):
        text = tt.text(tid)
        tokens.append(text)
        if entry is None:
            token_lps.append(None)
            tops.append(None)
            offsets.append(text_offset)
            text_offset += len(text)
            continue
        token_lps.append(entry[tid].logprob if tid in entry else None)
        top = {tt.text(t): lp for t, lp in _top(entry, top_n)}
        if tid in entry:
            top.setdefault(text, entry[tid].logprob)
        tops.append(top)
        offsets.append(text_offset)
        text_offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}, text_offset


def echo_logprobs(tt: TokenText, prompt_ids: list[int], prompt_logprobs: list | None, top_n: int,
                  completion: dict, echo_chars: int) -> dict:
    """`echo` with `logprobs`: the prompt's tokens (the first one's logprob null) in front of the
    completion's. The completion's text offsets already start after the echoed text (`echo_chars`)."""
    entries = list(prompt_logprobs or [])
    entries += [None] * (len(prompt_ids) - len(entries))
    prompt, _ = completion_logprobs(tt, prompt_ids, entries, top_n, 0)
    if not completion["tokens"]:
        return prompt
    return {k: prompt[k] + completion[k] for k in prompt} | {"text_offset": prompt["text_offset"] + completion["text_offset"]}


def chat_logprobs(tt: TokenText, token_ids: list[int], entries: list[dict[int, Logprob]], top_n: int) -> dict:
    """Chat format for these tokens: exactly the top `top_n` alternatives per token, as OpenAI."""
    content = []
    for tid, entry in zip(token_ids, entries):
        text, raw = tt.get(tid)
        alts = []
        for t, lp in _top(entry, top_n):
            alt_text, alt_raw = tt.get(t)
            alts.append({"token": alt_text, "logprob": lp, "bytes": list(alt_raw)})
        content.append({"token": text, "logprob": entry[tid].logprob if tid in entry else None,
                        "bytes": list(raw), "top_logprobs": alts})
    return {"content": content}

"""Token counts for the bench, and text of an exact token length.

With the target model's tokenizer (the bundled model's by default, or `--tokenizer PATH`)
every prompt length is measured exactly, as the server will see it: a completion prompt with
the tokenizer's special tokens, a chat prompt through the chat template. Without one the
counts are approximate (one token per word or punctuation mark) and the run says so.

Synthetic text is built from vocabulary entries that are a space plus lower-case letters
(" river"): byte-level BPE pre-tokenizers split on the space, so n such words are n tokens.
Every prompt is measured afterwards anyway, and nudged until it has the length asked for.
"""
from __future__ import annotations

import logging
import random
import re
from collections.abc import Callable, Sequence

from tokenfab.bench.chat_tools import as_plain_messages, native_message

log = logging.getLogger(__name__)

# Common English words, for synthetic text when no tokenizer is available.
_FALLBACK_WORDS = (
    "time year people way day man thing woman life child world school state family student group country "
    "problem hand part place case week company system program question work government number night point "
    "home water room mother area money story fact month lot right study book eye job word business issue "
    "side kind head house service friend father power hour game line end member law car city community name "
    "president team minute idea kid body information back parent face others level office door health person "
    "art war history party result change morning reason research girl guy moment air teacher force education"
).split()
_APPROX_PIECE = re.compile(r"\s?\w+|\s?[^\w\s]")


class TokenCounter:
    """Counts tokens with a tokenizer (exact) or by words and punctuation (approximate)."""

    def __init__(self, tokenizer=None, source: str = "approximate", warning: str | None = None):
        self.tokenizer = tokenizer
        self.source = source          # the tokenizer's path, or "approximate"
        self.warning = warning        # why counts are approximate, if they are
        self._words: list[str] | None = None

    @property
    def exact(self) -> bool:
        return self.tokenizer is not None

    # ---- counting -------------------------------------------------------------------------
    def count_text(self, texts: Sequence[str]) -> list[int]:
        """Tokens in raw text, no special tokens: for generated output."""
        if not texts:
            return []
        if self.tokenizer is None:
            return [len(_APPROX_PIECE.findall(t)) for t in texts]
        return [len(ids) for ids in self.tokenizer(list(texts), add_special_tokens=False)["input_ids"]]

    def count_prompts(self, prompts: Sequence[str]) -> list[int]:
        """Tokens of completion prompts as a server sees them (with BOS where the tokenizer adds one)."""
        if not prompts:
            return []
        if self.tokenizer is None:
            return self.count_text(prompts)
        return [len(ids) for ids in self.tokenizer(list(prompts))["input_ids"]]

    def count_chats(self, conversations: Sequence[list[dict]], tools: list[dict] | None = None) -> list[int]:
        """Tokens of chat prompts after the chat template, with the assistant turn opened."""
        return [len(ids) for ids in self.chat_ids(conversations, tools)]

    def chat_ids(self, conversations: Sequence[list[dict]], tools: list[dict] | None = None) -> list[list]:
        """Each chat prompt as the server's tokens (without a template: pseudo-tokens, a few of role markup
        per message, then the content's words), so two prompts' common prefix can be measured. `tools`
        go through the template where it has a tool format, else into the system message (chat_tools.py)."""
        if not conversations:
            return []
        native = self.tokenizer is not None and "tools" in (getattr(self.tokenizer, "chat_template", None) or "")
        if not native:
            conversations = [as_plain_messages(c, tools) for c in conversations]
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            # No template to apply: the contents plus a few tokens of role markup per message.
            return [[p for m in c for p in ("<|", m["role"], "|>", "\n", *self._pieces(m["content"]))]
                    + ["<|", "assistant"] for c in conversations]
        kw = {"tools": tools} if native and tools else {}
        texts = [self.tokenizer.apply_chat_template([native_message(m) for m in c] if native else c,
                                                    add_generation_prompt=True, tokenize=False, **kw)
                 for c in conversations]
        return [list(ids) for ids in self.tokenizer(texts, add_special_tokens=False)["input_ids"]]

    def _pieces(self, text: str) -> list:
        if self.tokenizer is None:
            return _APPROX_PIECE.findall(text)
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    # ---- synthesis -------------------------------------------------------------------------
    def words(self) -> list[str]:
        """Single-token words (" river"), sorted so that a seed gives the same text everywhere."""
        if self._words is None:
            if self.tokenizer is None:
                self._words = [" " + w for w in _FALLBACK_WORDS]
            else:
                found = set()
                for piece in self.tokenizer.get_vocab():
                    text = self.tokenizer.convert_tokens_to_string([piece])
                    body = text[1:]
                    if len(text) >= 3 and text[0] == " " and body.isascii() and body.isalpha() and body.islower():
                        found.add(text)
                self._words = sorted(found) or [" " + w for w in _FALLBACK_WORDS]
        return self._words

    def random_text(self, rng: random.Random, n_words: int) -> str:
        return "".join(rng.choices(self.words(), k=max(0, n_words)))

    def texts_of_length(self, rng: random.Random, targets: Sequence[int],
                        measure: Callable[[list[str]], list[int]], prefix: str = "") -> list[tuple[str, int]]:
        """Random texts t such that measure([prefix + t]) hits each target: (text, measured length).

        `measure` says how the server will count (a completion prompt, a chat turn, ...); the
        fixed overhead it adds (BOS, template markup, the prefix) is found once and subtracted.
        A text that still misses after a few nudges keeps its measured length, which is recorded.
        """
        if not targets:
            return []
        probe = self.random_text(rng, 16)
        overhead = measure([prefix + probe])[0] - 16
        texts = [self.random_text(rng, t - overhead) for t in targets]
        lengths = measure([prefix + t for t in texts])
        for i, target in enumerate(targets):
            for _ in range(4):  # merges across word joins are rare; a few nudges settle them
                diff = target - lengths[i]
                if diff == 0 or (diff < 0 and not texts[i]):
                    break
                if diff > 0:
                    texts[i] += self.random_text(rng, diff)
                else:
                    texts[i] = _drop_words(texts[i], -diff)
                lengths[i] = measure([prefix + texts[i]])[0]
        return list(zip(texts, lengths))


def _drop_words(text: str, n: int) -> str:
    cut = len(text)
    for _ in range(n):
        cut = text.rfind(" ", 0, cut)
        if cut <= 0:
            return ""
    return text[:cut]


def load_counter(tokenizer: str | None) -> TokenCounter:
    """The counter for `--tokenizer`: None means the bundled model's; "none" means approximate."""
    if tokenizer is not None and tokenizer.lower() in ("none", "approx", "approximate"):
        return TokenCounter(warning="token counts are approximate (--tokenizer none)")
    try:
        from tokenfab.files.bundled import bundled_model_path
        from tokenfab.files.tokenizer import load_tokenizer
        path = tokenizer or bundled_model_path()
        return TokenCounter(load_tokenizer(path), source=path)
    except Exception as e:  # any tokenizer that fails to load leaves the bench usable, approximately
        what = tokenizer or "the bundled model's tokenizer"
        return TokenCounter(warning=f"could not load {what} ({type(e).__name__}: {e}); token counts are "
                                    "approximate — pass --tokenizer PATH (a .gguf or HF folder) for exact counts")

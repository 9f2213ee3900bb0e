"""Structured output in the engine: grammars compiled by llguidance, one matcher per sequence, and a
token mask per step for every constrained sequence in the batch.

    compiler = GrammarCompiler(tokenizer, vocab_size, eos_token_ids)   # one per engine
    grammar = compiler.compile(spec)          # ValueError naming the problem; LRU-cached by the spec
    seq.grammar = grammar.matcher()           # a fresh matcher per sequence
    pending = compiler.masks(sampling_seqs)   # before the forward pass (optionally in a thread)
    logits -> Sampler(..., token_bitmask=pending.result())    # disallowed tokens -inf, before any filter
    seq.grammar.consume_token(token)          # after each accepted token (LLMEngine._append_token)

Why llguidance rather than xgrammar (both maintained; vLLM uses both): measured on the bundled model's
49,152-token vocabulary with a 3-level nested schema (docs/structured_output.md), compile was 1.9 ms
against 6.1 ms, a whole 91-token document (compile + every mask) 2.8 ms against 6.5 ms, and per-step
masks 13 us against 1 us median: both far below a decode step (10-30 ms here), while compilation
happens per request. llguidance is one 3 MB wheel with no dependencies; xgrammar pulls in triton.

The vocabulary may be padded: the model's logits can be wider than the tokenizer. The grammar
tokenizer is built with the wider of the two sizes, so ids without text are simply never allowed.
"""
from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from tokenfab.structured_output import StructuredOutputParams

log = logging.getLogger("tokenfab.engine")

# JSON is generated in json.dumps' default layout (", " and ": ", no newlines). Flexible whitespace
# lets a small model at temperature 1 emit newlines until max_tokens and never close the document;
# a schema may still ask for it with {"x-guidance": {"whitespace_flexible": true}}.
JSON_DEFAULTS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
CACHE_SIZE = 256            # compiled grammars kept (LRU by the spec's canonical text)


def _llguidance():
    try:
        import llguidance
        import llguidance.hf  # noqa: F401  (the tokenizer bridge)
    except ImportError:
        raise ValueError("structured output needs the llguidance package: pip install 'tokenfab[structured]'") from None
    return llguidance


class CompiledGrammar:
    """A compiled grammar; `matcher()` hands each sequence its own matcher in the start state."""

    def __init__(self, template) -> None:
        self._template = template

    def matcher(self):
        return self._template.deep_copy()


class GrammarCompiler:
    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: list[int], cache_size: int = CACHE_SIZE) -> None:
        self.hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.cache_size = cache_size
        self.overlap = False        # compute masks in a thread during the forward pass (see masks())
        self._ll_tokenizer = None
        self._cache: OrderedDict[tuple[str, str], CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()   # the server compiles on its event loop while the engine thread steps
        self._pool: ThreadPoolExecutor | None = None

    # -- compiling ------------------------------------------------------------------------------
    def tokenizer_info(self):
        """llguidance's view of the vocabulary, built once per engine on first use (~0.3-0.5 s here)."""
        with self._lock:
            if self._ll_tokenizer is None:
                llg = _llguidance()
                n_vocab = max(self.vocab_size, len(self.hf_tokenizer))
                self._ll_tokenizer = llg.hf.from_tokenizer(self.hf_tokenizer, n_vocab=n_vocab,
                                                           eos_token=self.eos_token_ids or None)
            return self._ll_tokenizer

    def compile(self, spec: StructuredOutputParams) -> CompiledGrammar:
        """The compiled grammar for `spec`; ValueError (with the compiler's reason) if it cannot be."""
        key = spec.key()
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        llg = _llguidance()
        tok = self.tokenizer_info()
        try:
            text = grammar_text(llg, spec)
        except ValueError as e:
            raise ValueError(f"invalid {spec.kind} for structured output: {e}") from None
        limits = llg.LLParserLimits(verbose_errors=False)
        template = llg.LLMatcher(tok, text, log_level=0, limits=limits)   # compiles; drops the GIL meanwhile
        if template.is_error():
            raise ValueError(f"the {_NAMES[spec.kind]} cannot be compiled: {template.get_error()[:500]}")
        compiled = CompiledGrammar(template)
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return compiled

    # -- masks ------------------------------------------------------------------------------------
    def masks(self, seqs) -> "PendingMasks | None":
        """Token masks for the constrained sequences among `seqs` (a step's sampling sequences), or None
        when none is constrained. Rows are logits rows: a sequence carrying k draft tokens (engine/spec)
        owns k + 1 rows, and row i's mask is its grammar's after drafts[:i] (see fill_bitmask). With
        `overlap`, they are computed in a worker thread while the caller runs the forward pass;
        `.result()` joins it."""
        rows, work = [], []
        r = 0
        for s in seqs:
            drafts = list(getattr(s, "spec_tokens", None) or ())
            if getattr(s, "grammar", None) is not None:
                rows.extend(range(r, r + 1 + len(drafts)))
                work.append((s.grammar, drafts))
            r += 1 + len(drafts)
        if not rows:
            return None
        if not self.overlap:
            return PendingMasks(rows, fill_bitmask(work, self.vocab_size))
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="tokenfab-masks")
        return PendingMasks(rows, self._pool.submit(fill_bitmask, work, self.vocab_size))


_NAMES = {"json": "JSON schema", "json_object": "JSON object grammar", "regex": "regex", "choice": "choice list",
          "grammar": "grammar"}


def grammar_text(llg, spec: StructuredOutputParams) -> str:
    """The llguidance grammar for a spec (not yet compiled)."""
    kind = spec.kind
    if kind in ("json", "json_object"):
        schema = {"type": "object"} if kind == "json_object" else spec.json
        if isinstance(schema, str):
            schema = json.loads(schema)
        return llg.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_DEFAULTS)
    if kind == "regex":
        return llg.LLMatcher.grammar_from_regex(spec.regex)
    if kind == "choice":
        return llg.grammar_from("choice", list(spec.choice))
    return llg.grammar_from("grammar", spec.grammar)     # GBNF is converted to Lark; Lark passes through


class PendingMasks:
    """The rows a step constrains and their bitmask (a tensor, or a Future of one)."""

    def __init__(self, rows: list[int], bitmask: torch.Tensor | Future) -> None:
        self.rows = rows
        self._bitmask = bitmask

    def result(self) -> tuple[list[int], torch.Tensor]:
        bm = self._bitmask.result() if isinstance(self._bitmask, Future) else self._bitmask
        return self.rows, bm


def fill_bitmask(work: list, vocab_size: int) -> torch.Tensor:
    """[rows, ceil(vocab/32)] int32 for (matcher, draft tokens) pairs: 1 + len(drafts) rows each, bit t
    of a row set when the matcher allows token t there. Row i of a pair is the mask after drafts[:i]:
    the drafts are consumed one by one and rolled back afterwards, so the matcher ends where it began.
    The drafts were cut to their grammar-valid prefix, without EOS, when proposed (valid_draft_prefix)."""
    words = (vocab_size + 31) // 32
    bm = torch.empty((sum(1 + len(d) for _, d in work), words), dtype=torch.int32)
    ptr, row_bytes = bm.data_ptr(), words * 4
    r = 0
    for m, drafts in work:
        m.unsafe_compute_mask_ptr(ptr + r * row_bytes, row_bytes)
        r += 1
        for d in drafts:
            ok = m.consume_token(d)
            assert ok, f"draft token {d} is not grammar-valid: drafts are cut when proposed (valid_draft_prefix)"
            m.unsafe_compute_mask_ptr(ptr + r * row_bytes, row_bytes)
            r += 1
        if drafts:
            m.rollback(len(drafts))
    return bm


def valid_draft_prefix(matcher, drafts: list[int], eos_token_ids) -> list[int]:
    """The longest prefix of `drafts` the matcher accepts from its current state, cut before any EOS
    (the target's own token ends a document: llguidance does not count an EOS it consumed, so it could
    not be rolled back) and before anything past a completed grammar. The matcher's state is unchanged."""
    n = matcher.validate_tokens(drafts)      # never consume a forbidden token: it leaves the matcher in error
    keep = 0
    for d in drafts[:n]:
        if d in eos_token_ids or matcher.is_stopped() or not matcher.consume_token(d):
            break
        keep += 1
    if keep:
        matcher.rollback(keep)
    return drafts[:keep]


def apply_token_bitmask(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor,
                        eos_token_ids: list[int]) -> torch.Tensor:
    """A copy of `logits` with the tokens each constrained row's mask forbids set to -inf.

    On CPU this is numpy, single-threaded: unpacking the bits and a select over 8 rows of 49k take
    about 1 ms, where the same torch ops on the engine's OpenMP pool took 20-50 ms on this shared
    2-core VM (measured: threads spinning against other load). A row whose mask allows nothing (a
    matcher in an error state) is left EOS, so it ends instead of drawing from an all -inf row.
    """
    vocab = logits.shape[1]
    allowed = _unpack(bitmask, vocab)
    dead = ~allowed.any(axis=1)
    if dead.any():
        log.warning("a structured-output matcher allowed no token; ending that sequence with EOS")
        allowed[np.ix_(dead.nonzero()[0], [t for t in eos_token_ids if t < vocab])] = True
    if logits.device.type != "cpu":
        mask = torch.from_numpy(allowed).to(logits.device)
        out = logits.clone(memory_format=torch.contiguous_format)
        idx = torch.tensor(rows, dtype=torch.long, device=logits.device)
        out[idx] = out[idx].masked_fill(~mask, float("-inf"))
        return out
    src = logits.detach().contiguous().numpy()
    if len(rows) == logits.shape[0] and rows == list(range(len(rows))):
        return torch.from_numpy(np.where(allowed, src, np.float32(-np.inf)).astype(src.dtype, copy=False))
    out = src.copy()
    out[rows] = np.where(allowed, src[rows], np.float32(-np.inf))
    return torch.from_numpy(out)


def _unpack(bitmask: torch.Tensor, vocab: int) -> np.ndarray:
    """[rows, words] int32 bitmask -> [rows, vocab] bool (bit t of a row: token t allowed)."""
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little").view(bool)
    if bits.shape[1] < vocab:        # a mask narrower than the logits: the extra ids are not tokens
        bits = np.pad(bits, ((0, 0), (0, vocab - bits.shape[1])))
    return bits[:, :vocab].copy()

"""ModelRunner: one rank's KV pool; turns a scheduled batch into tensors, runs the model once, returns logits.

The worker (worker.py) builds it over the model and the KV blocks it sized. `prepare` reads the
scheduled sequences' tokens, computed counts and block tables (engine/sequence.py) on rank 0 only;
every rank's `execute` runs the same flat batch (`StepInput`) on its own shard and KV heads.

The flat batch puts decodes (one new token) first, then prefill chunks, so the attention backend
handles all decodes in one batched call. Logits are computed only at each sequence's last scheduled
position, and only for sequences whose chunk reaches the end of their known tokens (they sample),
plus, for sequences asking for prompt logprobs, at every prompt position of their chunk (after the
sampling rows; see engine/prompt_logprobs.py). A prompt-only sequence (max_tokens 0) never samples.
A sequence carrying draft tokens (engine/spec) runs its last token and the drafts as 1 + k decode
rows with causal context lengths (row i sees the context up to its own position: every layer writes
all rows' K/V before any row attends), and gets logits at all of them, in order. So verification is
computed exactly as k + 1 plain decodes would be, and small steps stay on the one-call C decode stack.
"""
from __future__ import annotations

import math
import mmap
from dataclasses import dataclass

import torch

from tokenfab.model.attention import AttentionMetadata, Int8KVCache, PrefillChunk


@dataclass(slots=True)
class StepInput:
    """One step's flat batch: what every rank's forward reads (the first four fields) and what rank 0's
    core reads back (the sequences behind the logits rows; empty on the other ranks)."""
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor
    sampling_seqs: list   # the sequences that get a new token, in logits row order (1 + drafts rows each)
    # After the sampling rows: (sequence, first position, last position + 1) per prompt-logprobs run
    prompt_rows: list[tuple]


def rows_for_chunk(num_prompt_tokens: int, num_recorded: int, start: int, end: int) -> range:
    """Positions in [start, end) whose logits score a prompt token not recorded yet (engine/prompt_logprobs.py).

    Entry k (0-based) of the recorded list scores prompt token k + 1, from the logits at position k."""
    return range(max(start, num_recorded), min(end, num_prompt_tokens - 1))


def reserve_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: str) -> torch.Tensor:
    """A zero tensor whose CPU pages become resident only when first written: an anonymous mmap maps
    fresh zero pages on first touch, where torch.zeros writes every byte up front. A KV pool sized for
    max_num_seqs full-length sequences then costs RSS only for the blocks in use. Transparent huge
    pages are refused for it (numpy's calloc asked for them): with 2 MiB pages the first block of a
    sequence made 2 MiB resident in each layer's K and V slab, 120 MiB for the bundled model."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.tensor([], dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    buf = mmap.mmap(-1, nbytes)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        buf.madvise(mmap.MADV_NOHUGEPAGE)
    return torch.frombuffer(buf, dtype=torch.uint8).view(dtype).reshape(shape)


class ModelRunner:
    def __init__(self, model, num_blocks: int, block_size: int, kv_dtype: torch.dtype, device: str,
                 sliding=None):
        """kv_dtype torch.int8: the int8 KV cache (values plus a float32 scale per token and head).
        `sliding`: the core's sliding block map (engine/sliding_kv.SlidingBlocks): the sliding-window
        layers get their own pool of `sliding.num_blocks` blocks, addressed through `sliding.remap`."""
        cfg = model.config
        self.model, self.device, self.block_size = model, device, block_size
        self.sliding = sliding
        own = [sliding is not None and cfg.is_sliding(i) for i in range(cfg.num_layers)]
        glob, slid = self._pool(own.count(False), num_blocks, kv_dtype), None
        self.kv, self.kv_scales = glob[0], glob[1]
        if sliding is not None:
            slid = self._pool(own.count(True), sliding.num_blocks, kv_dtype)
        self.kv_caches = [(slid if own[i] else glob)[2][own[:i].count(own[i])] for i in range(cfg.num_layers)]

    def _pool(self, num_layers: int, num_blocks: int, kv_dtype: torch.dtype):
        """(values, int8 scales or None, per-layer (K, V) caches) for `num_layers` layers."""
        cfg = self.model.config
        shape = (num_layers, 2, num_blocks, self.block_size, cfg.num_kv_heads, cfg.head_dim)
        kv = reserve_zeros(shape, kv_dtype, self.device)
        if kv_dtype != torch.int8:
            return kv, None, [(kv[i, 0], kv[i, 1]) for i in range(num_layers)]
        scales = reserve_zeros(shape[:-1], torch.float32, self.device)
        compute = self.model.embed_tokens.weight.dtype
        return kv, scales, [tuple(Int8KVCache(kv[i, j], scales[i, j], compute) for j in (0, 1))
                            for i in range(num_layers)]

    def with_sliding(self, meta: AttentionMetadata) -> AttentionMetadata:
        """`meta` plus the sliding layers' view of it, when they have their own pool."""
        if self.sliding is not None:
            meta.sliding = self.sliding.remap(meta)
        return meta

    def prepare(self, batch) -> StepInput:
        """The flat batch for a scheduled one (engine/scheduler.ScheduledBatch): its sequences' new tokens,
        positions, slots and block tables, and which rows get logits."""
        bs = self.block_size
        # Decodes (and verifications) first, stable.
        order = sorted(range(len(batch)), key=lambda i: batch.num_new_tokens[i] != 1 and not batch.seqs[i].spec_tokens)
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        logits_idx: list[int] = []
        sampling: list = []
        dec_tables: list[list[int]] = []
        dec_lens: list[int] = []
        prefills: list[PrefillChunk] = []
        prompt_idx: list[int] = []
        prompt_rows: list[tuple] = []
        for i in order:
            seq, n = batch.seqs[i], batch.num_new_tokens[i]
            start = seq.num_computed_tokens
            end = start + n
            table = seq.block_table
            q0 = len(ids)
            tokens = seq.token_ids + seq.spec_tokens if seq.spec_tokens else seq.token_ids
            ids.extend(tokens[start:end])
            pos.extend(range(start, end))
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            if n == 1 or seq.spec_tokens:
                for p in range(start + 1, end + 1):     # one decode row per position, context up to it
                    dec_tables.append(table[: -(-p // bs)])
                    dec_lens.append(p)
            else:
                prefills.append(PrefillChunk(q0, n, end, torch.tensor(table[: -(-end // bs)], dtype=torch.long, device=self.device)))
            if end == len(tokens) and seq.max_tokens > 0:
                logits_idx.extend(range(len(ids) - 1 - len(seq.spec_tokens), len(ids)))
                sampling.append(seq)
            if seq.needs_prompt_logprobs:
                rows = rows_for_chunk(seq.num_prompt_tokens, len(seq.prompt_logprobs), start, end)
                if rows:
                    prompt_idx.extend(q0 + p - start for p in rows)
                    prompt_rows.append((seq, rows.start, rows.stop))
        dev = self.device
        dec_bt = dec_ln = None
        max_ctx = 0
        if dec_tables:
            width = max(len(t) for t in dec_tables)
            dec_bt = torch.tensor([t + [0] * (width - len(t)) for t in dec_tables], dtype=torch.long, device=dev)
            dec_ln = torch.tensor(dec_lens, dtype=torch.long, device=dev)
            max_ctx = max(dec_lens)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            num_decode_tokens=len(dec_tables),
            decode_block_tables=dec_bt,
            decode_context_lens=dec_ln,
            decode_max_context=max_ctx,
            prefills=prefills,
            positions=torch.tensor(pos, dtype=torch.long, device=dev),
        )
        self.with_sliding(meta)
        return StepInput(torch.tensor(ids, dtype=torch.long, device=dev), meta.positions,
                         meta, torch.tensor(logits_idx + prompt_idx, dtype=torch.long, device=dev), sampling,
                         prompt_rows)

    @torch.inference_mode()
    def execute(self, step: StepInput) -> torch.Tensor:
        return self.model(step.input_ids, step.positions, self.kv_caches, step.meta, step.logits_indices)

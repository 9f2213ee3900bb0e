"""Self-speculative (layerskip) proposer: the target's own first L layers, final norm and LM head
draft the tokens, greedily. No extra weights and no extra KV: drafting writes layers 0..L-1's K/V
for the drafted positions into the sequence's own blocks, and the verification pass recomputes and
overwrites every one of those slots (the drafts' K/V in layers below L equal what the target computes
for the same tokens; a rejected draft's slots are overwritten later).

Drafting is k decode steps of the shallow stack over all drafting sequences at once (the one-call
C decode stack takes it when the batch is small). The proposer must hold the blocks for the drafted
positions before it writes them, so it allocates them here; when the pool is short it drafts nothing.
"""
from __future__ import annotations

import torch

from tokenfab.engine.sampler import greedy_ids
from tokenfab.model.attention import AttentionMetadata


class LayerSkipProposer:
    def __init__(self, model, runner, block_manager, num_layers: int, vocab_size: int) -> None:
        total = model.config.num_layers
        if not 1 <= num_layers < total:
            raise ValueError(f"speculative_config num_layers must be in [1, {total - 1}] for this model "
                             f"({total} layers), got {num_layers}")
        self.model, self.runner, self.bm = model, runner, block_manager
        self.num_layers, self.vocab_size = num_layers, vocab_size

    @torch.inference_mode()
    def propose_batch(self, seqs: list, ks: list[int]) -> list[list[int]]:
        """Up to ks[i] greedy draft tokens for each decoding sequence seqs[i]."""
        drafts: list[list[int]] = [[] for _ in seqs]
        live = []
        for i, (seq, k) in enumerate(zip(seqs, ks)):
            # Blocks for the last token plus k drafts; the scheduler's allocation finds them in place.
            if k > 0 and self.bm.allocate(seq, 1 + k):
                live.append(i)
        if not live:
            return drafts
        bs, dev = self.bm.block_size, self.runner.device
        last = {i: seqs[i].token_ids[-1] for i in live}
        for j in range(max(ks[i] for i in live)):
            rows = [i for i in live if ks[i] > j]
            if not rows:
                break
            pos = [seqs[i].num_tokens - 1 + j for i in rows]
            tables = [seqs[i].block_table[: p // bs + 1] for i, p in zip(rows, pos)]
            width = max(len(t) for t in tables)
            positions = torch.tensor(pos, dtype=torch.long, device=dev)
            meta = AttentionMetadata(
                slot_mapping=torch.tensor([t[p // bs] * bs + p % bs for t, p in zip(tables, pos)], dtype=torch.long, device=dev),
                num_decode_tokens=len(rows),
                decode_block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long, device=dev),
                decode_context_lens=torch.tensor([p + 1 for p in pos], dtype=torch.long, device=dev),
                decode_max_context=max(pos) + 1, prefills=[], positions=positions)
            self.runner.with_sliding(meta)
            ids = torch.tensor([last[i] for i in rows], dtype=torch.long, device=dev)
            logits = self.model(ids, positions, self.runner.kv_caches, meta,
                                torch.arange(len(rows), device=dev), num_layers=self.num_layers)
            for i, t in zip(rows, greedy_ids(logits[:, : self.vocab_size])):
                drafts[i].append(t)
                last[i] = t
        return drafts

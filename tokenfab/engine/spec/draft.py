"""Draft-model proposer: a smaller model with the target's tokenizer drafts k tokens greedily.

The draft model has its own paged KV pool with the *same number of blocks* as the target's, so a
sequence's block table addresses both: block b holds the target's K/V in the target pool and the
draft's K/V in the draft pool. The engine sizes the two together from one budget (a block costs the
target's plus the draft's bytes; the worker loads and sizes both: worker/draft_model.py), and the BlockManager, the prefix cache,
preemption and trimming work on both at once with nothing new to track.

What the draft has computed is tracked per sequence (`SeqSpecState.draft_computed`, with the
preemption count it belongs to). Before drafting, the draft catches up on the tokens it has not seen
(the whole prompt for a new or preempted sequence, the target's last token after a round, and the
tokens of steps that did not speculate) in one batched forward, then drafts k - 1 more tokens as
decode steps. Catching up over a prefix-cached block rewrites the draft K/V the block already holds
with the same values (same tokens, same positions), so sharing blocks is safe. After verification
the draft's K/V is valid up to the accepted tokens (`observe`): rejected drafts' slots are rewritten
later, as in the target.

Drafts are greedy (a point mass), so verification accepts them with the same rule as ngram's.
"""
from __future__ import annotations

import torch

from tokenfab.engine.sampler import greedy_ids
from tokenfab.model.attention import AttentionMetadata, PrefillChunk


class DraftModelProposer:
    def __init__(self, model, runner, block_manager, vocab_size: int) -> None:
        """`runner`: a ModelRunner over the draft model with as many blocks as the target's pool."""
        self.model, self.runner, self.bm, self.vocab_size = model, runner, block_manager, vocab_size

    @staticmethod
    def _state(seq):
        st = seq.spec_state
        if st.draft_epoch != seq.num_preemptions:    # preempted: its blocks (and the draft's K/V) are gone
            st.draft_epoch, st.draft_computed = seq.num_preemptions, 0
        return st

    @torch.inference_mode()
    def propose_batch(self, seqs: list, ks: list[int]) -> list[list[int]]:
        """Up to ks[i] greedy draft tokens for each decoding sequence seqs[i]."""
        drafts: list[list[int]] = [[] for _ in seqs]
        # Blocks for the last token plus k drafts; the scheduler's allocation finds them in place.
        live = [i for i, (seq, k) in enumerate(zip(seqs, ks)) if k > 0 and self.bm.allocate(seq, 1 + k)]
        if not live:
            return drafts
        bs, dev = self.bm.block_size, self.runner.device
        # 1. Catch up: every token the draft has not computed, up to and including the last one.
        #    Single-token catch-ups run as decode rows (first), longer ones as prefill chunks.
        starts = {i: min(self._state(seqs[i]).draft_computed, seqs[i].num_computed_tokens) for i in live}
        order = sorted(live, key=lambda i: seqs[i].num_tokens - starts[i] != 1)
        ids, pos, slots, dec_tables, dec_lens, prefills, last_rows = [], [], [], [], [], [], []
        for i in order:
            seq, start = seqs[i], starts[i]
            end, table = seq.num_tokens, seq.block_table
            q0 = len(ids)
            ids.extend(seq.token_ids[start:end])
            pos.extend(range(start, end))
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            if end - start == 1:
                dec_tables.append(table[: -(-end // bs)])
                dec_lens.append(end)
            else:
                prefills.append(PrefillChunk(q0, end - start, end,
                                             torch.tensor(table[: -(-end // bs)], dtype=torch.long, device=dev)))
            last_rows.append(len(ids) - 1)
        nxt = self._run(ids, pos, slots, dec_tables, dec_lens, prefills, last_rows)
        for i, t in zip(order, nxt):
            drafts[i].append(t)
            self._state(seqs[i]).draft_computed = seqs[i].num_tokens
        # 2. Draft: k - 1 more greedy decode steps over the sequences that want them.
        for j in range(1, max(ks[i] for i in live)):
            rows = [i for i in live if ks[i] > j]
            if not rows:
                break
            pos = [seqs[i].num_tokens - 1 + j for i in rows]
            tables = [seqs[i].block_table[: p // bs + 1] for i, p in zip(rows, pos)]
            nxt = self._run([drafts[i][-1] for i in rows], pos,
                            [t[p // bs] * bs + p % bs for t, p in zip(tables, pos)], tables,
                            [p + 1 for p in pos], [], list(range(len(rows))))
            for i, t in zip(rows, nxt):
                drafts[i].append(t)
                self._state(seqs[i]).draft_computed += 1
        return drafts

    def _run(self, ids, pos, slots, dec_tables, dec_lens, prefills, logit_rows) -> list[int]:
        dev = self.runner.device
        dec_bt = dec_ln = None
        if dec_tables:
            width = max(len(t) for t in dec_tables)
            dec_bt = torch.tensor([t + [0] * (width - len(t)) for t in dec_tables], dtype=torch.long, device=dev)
            dec_ln = torch.tensor(dec_lens, dtype=torch.long, device=dev)
        positions = torch.tensor(pos, dtype=torch.long, device=dev)
        meta = AttentionMetadata(slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
                                 num_decode_tokens=len(dec_tables), decode_block_tables=dec_bt,
                                 decode_context_lens=dec_ln, decode_max_context=max(dec_lens, default=0),
                                 prefills=prefills, positions=positions)
        logits = self.model(torch.tensor(ids, dtype=torch.long, device=dev), positions, self.runner.kv_caches, meta,
                            torch.tensor(logit_rows, dtype=torch.long, device=dev))
        return greedy_ids(logits[:, : self.vocab_size])

    def observe(self, seq) -> None:
        """After verification and commit: the draft's K/V is valid only as far as the target's."""
        st = seq.spec_state
        if st is not None:
            st.draft_computed = min(st.draft_computed, seq.num_computed_tokens)

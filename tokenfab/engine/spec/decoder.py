"""SpecDecoder: the engine's one entry point to speculative decoding.

Each step, around the engine's own schedule -> execute -> update_from_output:
1. `propose(running)`, before scheduling: each decoding sequence that opts in (SamplingParams
   `speculative`, the default) gets up to k draft tokens in `seq.spec_tokens`. The scheduler runs it
   with 1 + len(drafts) new tokens when budget and blocks allow (else it drops the drafts), and the
   runner takes logits at all of those positions.
2. `sample(sampler, logits, step)`: plain rows go to the sampler as usual; a speculating sequence's
   k + 1 rows are verified (verify.py) into the accepted drafts plus one token of the target's own.
   A shadow draft (policy.py) is checked against the first token here.
3. The scheduler's `update_from_output` appends those tokens one at a time (so stop strings,
   stop_token_ids, EOS, max_tokens and min_tokens hold exactly), marks the accepted drafts' K/V as
   computed, registers the blocks now fully accepted in the prefix cache, and frees the blocks beyond
   what the sequence needs. Rejected drafts' slots are simply overwritten later. `after_update(seqs)`
   then tells a draft-model proposer how far the target's K/V now reach.
4. `observe_step(...)`, after a decode-only step: its wall time, for the policy's measured costs.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tokenfab.config import SpeculativeConfig
from tokenfab.engine.sampler import SampledToken, Sampler, SampleRow, plain_greedy
from tokenfab.engine.spec.ngram import NgramProposer
from tokenfab.engine.spec.policy import ROW_COST, AdaptivePolicy, row_cost_of
from tokenfab.engine.spec.verify import accept_greedy, accept_sampled, target_probs
from tokenfab.engine.structured import apply_token_bitmask, valid_draft_prefix


@dataclass(slots=True)
class SpecStats:
    """Counters since start, as vLLM's spec_decode_* metrics count them."""
    num_drafts: int = 0                  # verification rounds (sequences x steps that carried drafts)
    num_draft_tokens: int = 0            # tokens proposed and scored
    num_accepted_tokens: int = 0         # of those, accepted
    accepted_per_pos: list[int] = field(default_factory=list)   # [i]: rounds whose draft i was accepted

    def fill(self, stats) -> None:
        """Copy these counts into an EngineStats (engine/client.py)."""
        stats.spec_decode_num_drafts, stats.spec_decode_num_draft_tokens = self.num_drafts, self.num_draft_tokens
        stats.spec_decode_num_accepted_tokens = self.num_accepted_tokens
        stats.spec_decode_num_accepted_tokens_per_pos = tuple(self.accepted_per_pos)


class SpecDecoder:
    def __init__(self, config: SpeculativeConfig, max_model_len: int, vocab_size: int, model=None, runner=None,
                 block_manager=None, draft=None, eos_token_ids: list[int] = ()) -> None:
        """`draft`: (draft model, its ModelRunner) for method "draft" (the engine builds them: it sizes
        the KV pools)."""
        self.config = config
        self.eos_token_ids = frozenset(eos_token_ids)   # never drafted for a grammar (valid_draft_prefix)
        self.k_max = config.num_speculative_tokens
        self.max_model_len, self.vocab_size = max_model_len, vocab_size
        draft_cost = 0.0             # the proposer's cost per draft token, in plain decode steps
        if config.method == "layerskip":
            from tokenfab.engine.spec.layerskip import LayerSkipProposer
            # 24 of 30 on the bundled model: the best of L in {8, 15, 20, 24, 27, 29}, all slower than
            # plain decoding there (benchmarks/layerskip_depth.py; docs/speculative.md)
            layers = config.num_layers or max(1, min(model.config.num_layers - 1, round(0.8 * model.config.num_layers)))
            self.proposer = LayerSkipProposer(model, runner, block_manager, layers, vocab_size)
            draft_cost = layers / model.config.num_layers
        elif config.method == "draft":
            from tokenfab.engine.spec.draft import DraftModelProposer
            self.proposer = DraftModelProposer(draft[0], draft[1], block_manager, vocab_size)
            draft_cost = _num_params(draft[0]) / _num_params(model)
        else:
            self.proposer = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
        row_cost = row_cost_of(model, self.k_max + 1) if model is not None else ROW_COST
        self.policy = AdaptivePolicy(self.k_max, config.max_batch_size, config.adaptive, draft_cost, row_cost)
        self.stats = SpecStats(accepted_per_pos=[0] * self.k_max)
        self.step_index = 0

    # -- 1. propose --------------------------------------------------------------------------------
    def propose(self, running: list) -> None:
        self.step_index += 1
        decoding = []
        for seq in running:
            seq.spec_tokens = []
            if seq.spec_state is not None:
                seq.spec_state.shadow = None
            if seq.num_tokens - seq.num_computed_tokens == 1:
                decoding.append(seq)
        batched = hasattr(self.proposer, "propose_batch")
        shadows = self.policy.shadows and not batched      # one-token shadow drafts are free (policy.py)
        if not self.policy.step_allows(len(decoding)):
            # No drafts in a batch this large, but one sequence per step (round robin) gets a shadow
            # draft, so that the rates are current when the batch shrinks to where drafts may pay.
            seq = decoding[self.step_index % len(decoding)] if decoding else None
            if shadows and seq is not None and seq.params.speculative:
                self._shadow(seq)
            return
        seqs, ks = [], []
        room = self.config.max_step_rows - len(decoding)      # draft rows this step may add
        cost = self.policy.cost(len(decoding))
        for seq in decoding:
            if not seq.params.speculative:
                continue
            if seq.spec_state is None:
                seq.spec_state = self.policy.new_state()
            # Never draft past what the sequence may still emit: the target adds one token of its own.
            left = min(seq.max_tokens - seq.num_output_tokens, self.max_model_len - seq.num_tokens) - 1
            k = min(self.policy.k_for(seq.spec_state, self.step_index, cost), left)
            if k > 0:
                seqs.append(seq)
                ks.append(k)
            elif shadows and left > 0:          # free to watch: what would it have drafted?
                self._shadow(seq)
        if batched:                                      # a model-based proposer drafts all at once
            for i, k in enumerate(ks):
                ks[i] = max(0, min(k, room))
                room -= ks[i]
            for seq, drafts in zip(seqs, self.proposer.propose_batch(seqs, ks) if seqs else []):
                seq.spec_tokens = self._grammar_cut(seq, drafts)
        else:
            for seq, k in zip(seqs, ks):
                if room <= 0:
                    break
                seq.spec_tokens = self._grammar_cut(seq, self.proposer.propose(seq.token_ids, min(k, room)))
                room -= len(seq.spec_tokens)

    def _shadow(self, seq) -> None:
        if seq.spec_state is None:
            seq.spec_state = self.policy.new_state()
        drafts = self.proposer.propose(seq.token_ids, 1)
        seq.spec_state.shadow = drafts[0] if drafts else None

    def _grammar_cut(self, seq, drafts: list[int]) -> list[int]:
        """Structured output: drafts up to the first one the sequence's grammar forbids. Verification
        then masks each of the k + 1 rows with the grammar's state after the drafts before it
        (structured.fill_bitmask), so every token accepted is one the grammar allows there."""
        if seq.grammar is None or not drafts:
            return drafts
        return valid_draft_prefix(seq.grammar, drafts, self.eos_token_ids)

    # -- 2. verify ---------------------------------------------------------------------------------
    def sample(self, sampler: Sampler, logits: torch.Tensor, sampling_seqs: list,
               token_bitmask: tuple[list[int], torch.Tensor] | None = None) -> list[list[SampledToken]]:
        """Tokens per sampling sequence; `logits` has 1 + len(seq.spec_tokens) rows per sequence.
        `token_bitmask`: the structured-output masks by logits row (a speculating sequence's k + 1 rows
        each have their own; engine/structured.py)."""
        plain_idx, plain_rows, spec = [], [], []
        r = 0
        for i, seq in enumerate(sampling_seqs):
            if seq.spec_tokens:
                spec.append((i, r))
            else:
                plain_idx.append(r)
                plain_rows.append(SampleRow(seq.params, seq.prompt_token_ids, seq.output_token_ids, seq.generator))
            r += 1 + len(seq.spec_tokens)
        assert r == logits.shape[0], (r, tuple(logits.shape))
        out: list[list[SampledToken]] = [[] for _ in sampling_seqs]
        if plain_rows:
            rows = logits if not spec else logits[torch.tensor(plain_idx, device=logits.device)]
            plain = [i for i, s in enumerate(sampling_seqs) if not s.spec_tokens]
            plain_mask = None
            if token_bitmask is not None:       # re-index the plain masked rows among the plain rows
                where = {r: j for j, r in enumerate(plain_idx)}
                picked = [(where[r], m) for m, r in enumerate(token_bitmask[0]) if r in where]
                if picked:
                    plain_mask = ([j for j, _ in picked], token_bitmask[1][[m for _, m in picked]])
            for i, tok in zip(plain, sampler(rows, plain_rows, plain_mask)):
                out[i] = [tok]
        for i, r in spec:
            seq = sampling_seqs[i]
            n = 1 + len(seq.spec_tokens)
            mask = None
            if token_bitmask is not None and seq.grammar is not None:
                m0 = token_bitmask[0].index(r)         # its k + 1 rows are consecutive
                mask = (list(range(n)), token_bitmask[1][m0:m0 + n])
            out[i] = self._verify(sampler, logits[r:r + n], seq, mask)
        for seq, tokens in zip(sampling_seqs, out):
            st = seq.spec_state
            if st is not None and st.shadow is not None:      # a shadow draft: would it have been accepted?
                self.policy.observe(st, 1, int(tokens[0].token_id == st.shadow), self.step_index)
                st.shadow = None
        return out

    def _verify(self, sampler: Sampler, logits: torch.Tensor, seq, mask=None) -> list[SampledToken]:
        drafts, p = seq.spec_tokens, seq.params
        x = logits[:, : self.vocab_size]
        if mask is not None:   # grammar first, as in the sampler: filters, acceptance and logprobs see only allowed tokens
            x = apply_token_bitmask(x, *mask, sampler.eos_token_ids)
        out = seq.output_token_ids
        if mask is None and plain_greedy(p, len(out)):   # nothing to process: the argmax of the raw rows
            accepted, nxt = accept_greedy(x, drafts)
            self._count(seq, len(drafts), len(accepted))
            return [SampledToken(t, None, None) for t in accepted + [nxt]]
        # Row i is scored as if d_1..d_i were already output: penalties and min_tokens see them.
        rows = [SampleRow(p, seq.prompt_token_ids, out + drafts[:i], seq.generator) for i in range(len(drafts) + 1)]
        processed = sampler.process_logits(x, rows)
        if p.greedy:
            accepted, nxt = accept_greedy(processed, drafts)
        else:
            accepted, nxt = accept_sampled(target_probs(processed, p), drafts, seq.generator)
        tokens = accepted + [nxt]
        self._count(seq, len(drafts), len(accepted))
        if p.logprobs is None:
            return [SampledToken(t, None, None) for t in tokens]
        raw = torch.log_softmax(x[: len(tokens)].float(), dim=-1)   # of the raw logits, as the sampler
        chosen = raw.gather(1, torch.tensor(tokens, device=raw.device)[:, None])[:, 0].tolist()
        top_v, top_i = raw.topk(p.logprobs, dim=-1) if p.logprobs else (raw[:, :0], raw[:, :0].long())
        return [SampledToken(t, lp, dict(zip(ti, tv)))
                for t, lp, ti, tv in zip(tokens, chosen, top_i.tolist(), top_v.tolist())]

    def _count(self, seq, num_drafts: int, num_accepted: int) -> None:
        s = self.stats
        s.num_drafts += 1
        s.num_draft_tokens += num_drafts
        s.num_accepted_tokens += num_accepted
        for i in range(num_accepted):
            s.accepted_per_pos[i] += 1
        self.policy.observe(seq.spec_state, num_drafts, num_accepted, self.step_index)

    # -- 3. after the update ----------------------------------------------------------------------
    def after_update(self, seqs) -> None:
        """After `Scheduler.update_from_output` appended the sampled tokens (accepted drafts included):
        the draft model's K/V is valid only as far as the target's."""
        if self.config.method == "draft":
            for seq in seqs:
                if not seq.status.finished:
                    self.proposer.observe(seq)

    # -- 4. measure --------------------------------------------------------------------------------
    def observe_step(self, num_seqs: int, draft_rows: int, seconds: float) -> None:
        """A decode-only step (each of num_seqs sequences one row plus its drafts) and its wall time."""
        self.policy.observe_step(num_seqs, draft_rows, seconds)


def _num_params(model) -> int:
    """Parameters as the model was configured (quantized layers count as their float shapes)."""
    c = model.config
    per_layer = (c.hidden_size * (c.num_heads + 2 * c.num_kv_heads) * c.head_dim + c.num_heads * c.head_dim * c.hidden_size
                 + 3 * c.hidden_size * c.intermediate_size)
    return c.num_layers * per_layer + c.vocab_size * c.hidden_size

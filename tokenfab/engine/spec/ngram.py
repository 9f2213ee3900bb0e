"""Prompt lookup (n-gram) proposer: no extra model.

Match the last n tokens (n from prompt_lookup_max down to prompt_lookup_min) against the prompt and
the output so far; propose the k tokens that followed the latest earlier occurrence. Outputs that
copy their input (summaries, code edits, RAG answers) match often; open-ended text rarely does, and
then nothing is proposed and the step stays a plain decode.
"""
from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    def __init__(self, lookup_min: int, lookup_max: int) -> None:
        self.lookup_min, self.lookup_max = lookup_min, lookup_max

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        """Up to k draft tokens following the context `token_ids`; [] when no n-gram matches."""
        L = len(token_ids)
        if k < 1 or L <= self.lookup_min:
            return []
        toks = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.lookup_max, L - 1), self.lookup_min - 1, -1):
            pattern = toks[L - n:]
            # Windows starting at i < L - n: earlier occurrences, each followed by at least one token.
            windows = sliding_window_view(toks[:L - 1], n)
            hits = np.flatnonzero((windows == pattern).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return toks[start:start + k].tolist()
        return []

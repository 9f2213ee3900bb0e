"""Aggregates of the agent workload (agent.py) over a run: TTFT by turn index, session times, and how
many of the prompt tokens were new.

- TTFT by turn: the percentiles of turn k's TTFT over the sessions that sent a turn k, k = 1, 2, …
  A server whose prefix cache keeps each session's history answers turn 8 about as fast as turn 1.
- Session time: from the first turn's send to the last turn's last token, think times included, over
  the sessions whose every turn succeeded.
- Tokens re-sent against tokens new: `prompt_tokens` adds up every turn's whole prompt (what the
  client sent); `new_tokens` only the part of each that no earlier request of the run began with, in
  send order: the longest prefix, in tokens, shared with any prompt sent before is not new. The
  difference is what an ideal prefix cache would not prefill again; a server's own hit rate
  (prefix_cache.py) sits below it by its block granularity and its evictions.
"""
from __future__ import annotations

from dataclasses import dataclass

from tokenfab.bench.aggregate import metric_stats
from tokenfab.bench.timing import RequestRecord


class SentPrefixes:
    """Every prompt sent so far, as a token trie: how much of a new one was sent before."""

    def __init__(self) -> None:
        self._root: dict = {}

    def add(self, ids: list) -> int:
        """Record `ids`; returns the length of its longest prefix that an earlier prompt began with."""
        node, seen = self._root, 0
        for t in ids:
            if t not in node:
                break
            node, seen = node[t], seen + 1
        for t in ids[seen:]:
            node = node.setdefault(t, {})
        return seen


@dataclass(slots=True)
class TurnRecord:
    session: int
    turn: int                 # 1-based
    record: RequestRecord
    new_tokens: int


def session_summary(turns: list[TurnRecord], planned: list[int], think_s: list[list[float]],
                    percentiles: list[float], prefix_cache: dict | None) -> dict:
    """The `sessions` section of a run. `planned`: each session's turn count; `think_s`: its think times."""
    by_session: dict[int, list[TurnRecord]] = {i: [] for i in range(len(planned))}
    for t in turns:
        by_session[t.session].append(t)
    records = []
    for i, n in enumerate(planned):
        mine = sorted(by_session[i], key=lambda t: t.turn)
        ok = len(mine) == n and all(t.record.success for t in mine)
        start = mine[0].record.sent_s if mine else None
        end = max(t.record.end_s for t in mine) if mine else None
        records.append({"index": i, "turns_planned": n, "turns_sent": len(mine), "success": ok,
                        "start_s": start, "end_s": end,
                        "session_ms": (end - start) * 1e3 if ok else None,
                        "think_s": think_s[i][1:], "requests": [t.record.index for t in mine]})
    prompt = sum(t.record.prompt_len for t in turns)
    new = sum(t.new_tokens for t in turns)
    server = [t.record.server_prompt_tokens for t in turns]
    out = {"num_sessions": len(planned), "completed": sum(r["success"] for r in records),
           "failed": sum(not r["success"] for r in records), "turns_sent": len(turns),
           "prompt_tokens": prompt, "new_tokens": new, "resent_share": 1 - new / prompt if prompt else None,
           "server_prompt_tokens": sum(server) if server and None not in server else None,
           "prefix_cache": prefix_cache}
    out.update(metric_stats("session", [r["session_ms"] for r in records if r["success"]], percentiles))
    out["by_turn"] = by_turn(turns, percentiles)
    out["records"] = records
    return out


def by_turn(turns: list[TurnRecord], percentiles: list[float]) -> list[dict]:
    """One row per turn index: requests, TTFT statistics, mean prompt and new tokens."""
    rows = []
    for k in sorted({t.turn for t in turns}):
        at = [t for t in turns if t.turn == k]
        ok = [t for t in at if t.record.success]
        row = {"turn": k, "requests": len(at), "completed": len(ok),
               "mean_prompt_tokens": sum(t.record.prompt_len for t in at) / len(at),
               "mean_new_tokens": sum(t.new_tokens for t in at) / len(at)}
        row.update(metric_stats("ttft", [t.record.ttft_ms for t in ok], percentiles))
        rows.append(row)
    return rows

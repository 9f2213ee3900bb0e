"""The agent workload of `bench serve --dataset agent`: sessions whose turns resend their history.

An agent calls the same model many times in a row, with a long system prompt and tool definitions
repeated in every call and each result fed back. A session here is:

- a system prompt shared by every session of the run (`--system-len` tokens) and `--num-tools`
  function tools, sent as the request's `tools` with every turn;
- N turns (`--turns`, drawn per session). Turn 1 sends [system, user]. Each later turn sends the
  whole history (every earlier message, the server's replies as it gave them) plus a new message:
  the results of the previous reply's tool calls (one `role: "tool"` message per call, `--tool-len`
  tokens in all) when the reply called tools, else a new user message (`--user-len` tokens);
- a think time before each later turn (`--think-time`): the tool runs, or the user reads and types.

The synthetic text is drawn before the run from the bench's single-token words (tokens.py), so its
lengths are exact for the bench's counter and no two sessions share anything but the system prompt
and the tools. Only the server's replies are learnt during the run.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np

from tokenfab.bench.client import RawResult
from tokenfab.bench.lengths import parse_length
from tokenfab.bench.tokens import TokenCounter

_TOOL_NAMES = ("search_files", "read_file", "run_tests", "edit_file", "list_directory", "fetch_url",
               "query_database", "send_message")


@dataclass(frozen=True, slots=True)
class ThinkTime:
    """Seconds between a turn's reply and the next turn: fixed, or exponential with a mean."""
    kind: str       # fixed | exponential
    mean_s: float

    def sample(self, rng: np.random.Generator, n: int) -> list[float]:
        if self.kind == "fixed" or self.mean_s == 0:
            return [self.mean_s] * n
        return rng.exponential(self.mean_s, size=n).tolist()

    def describe(self) -> str:
        return f"{self.mean_s:g} s" if self.kind == "fixed" else f"exponential, mean {self.mean_s:g} s"


def parse_think_time(spec: str) -> ThinkTime:
    """``"2"`` or ``"fixed:2"`` (seconds), ``"exp:2"`` or ``"exponential:2"`` (mean seconds)."""
    text = str(spec).strip()
    kind, _, value = text.rpartition(":")
    kind = {"": "fixed", "fixed": "fixed", "exp": "exponential", "exponential": "exponential"}.get(kind)
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if kind is None or not seconds >= 0:
        raise ValueError(f"--think-time {text!r}: expected seconds >= 0 as N, fixed:N or exp:MEAN")
    return ThinkTime(kind, seconds)


@dataclass(slots=True)
class AgentConfig:
    """The agent workload's settings; the `--num-sessions`, `--turns`, … flags map onto these one to one."""
    num_sessions: int = 16
    turns: str = "4"                 # a length spec (lengths.py): 4, uniform:2:8, …
    system_len: str = "1024"         # drawn once: the system prompt every session shares
    user_len: str = "64"
    tool_len: str = "256"            # a turn's tool results, all calls together
    output_len: str = "128"          # max_tokens per turn
    think_time: str = "exp:1"
    num_tools: int = 4
    range_ratio: float = 0.0

    def validate(self) -> None:
        """ValueError naming the flag, for any setting that cannot make a workload."""
        if self.num_sessions < 1:
            raise ValueError(f"--num-sessions {self.num_sessions}: need at least 1")
        if not 0 <= self.num_tools <= len(_TOOL_NAMES):
            raise ValueError(f"--num-tools {self.num_tools}: need 0 to {len(_TOOL_NAMES)}")
        for flag, spec in (("--turns", self.turns), ("--system-len", self.system_len), ("--user-len", self.user_len),
                           ("--tool-len", self.tool_len), ("--output-len", self.output_len)):
            try:
                parse_length(spec, self.range_ratio)
            except ValueError as e:
                raise ValueError(f"{flag}: {e}") from None
        parse_think_time(self.think_time)


@dataclass(slots=True)
class SessionPlan:
    """What one session will send, drawn before the run; turn k uses entry k of each list."""
    index: int
    user_texts: list[str]
    tool_texts: list[str]        # split over the calls of the reply they answer
    output_lens: list[int]
    think_s: list[float]         # before each turn; 0 before the first

    @property
    def turns(self) -> int:
        return len(self.output_lens)


@dataclass(slots=True)
class AgentWorkload:
    system: str
    tools: list[dict]
    sessions: list[SessionPlan]

    @property
    def num_turns(self) -> int:
        return sum(s.turns for s in self.sessions)


def build_workload(cfg: AgentConfig, counter: TokenCounter, seed: int) -> AgentWorkload:
    np_rng, rng = np.random.default_rng(seed), random.Random(seed)
    n = cfg.num_sessions
    turns = parse_length(cfg.turns, cfg.range_ratio).sample(np_rng, n)
    total = sum(turns)
    system_len = parse_length(cfg.system_len, cfg.range_ratio).sample(np_rng, 1)
    users = parse_length(cfg.user_len, cfg.range_ratio).sample(np_rng, total)
    tools = parse_length(cfg.tool_len, cfg.range_ratio).sample(np_rng, total)
    outs = parse_length(cfg.output_len, cfg.range_ratio).sample(np_rng, total)
    thinks = parse_think_time(cfg.think_time).sample(np_rng, total)
    texts = counter.texts_of_length(rng, system_len + users + tools + [12] * cfg.num_tools, counter.count_text)
    system, rest = texts[0][0], [t for t, _ in texts[1:]]
    user_texts, tool_texts, descriptions = rest[:total], rest[total:2 * total], rest[2 * total:]
    sessions, at = [], 0
    for i, k in enumerate(turns):
        sessions.append(SessionPlan(i, user_texts[at:at + k], tool_texts[at:at + k], outs[at:at + k],
                                    [0.0] + thinks[at + 1:at + k]))
        at += k
    return AgentWorkload(system, [_tool(name, d.strip()) for name, d in zip(_TOOL_NAMES, descriptions)],
                         sessions)


def _tool(name: str, description: str) -> dict:
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": {"query": {"type": "string", "description": "what to act on"}},
                       "required": ["query"]}}}


def first_messages(w: AgentWorkload, plan: SessionPlan) -> list[dict]:
    return [{"role": "system", "content": w.system}, {"role": "user", "content": plan.user_texts[0]}]


def next_messages(history: list[dict], reply: RawResult, plan: SessionPlan, turn: int) -> list[dict]:
    """Turn `turn`'s messages (0-based, > 0): the history, the reply to it, and then the answers to the
    reply's tool calls, or a new user message when it called none."""
    calls = [{"id": c["id"] or f"call_{plan.index}_{turn}_{k}", "type": "function",
              "function": {"name": c["function"]["name"], "arguments": c["function"]["arguments"] or "{}"}}
             for k, c in enumerate(reply.tool_calls)]
    if not calls:
        return history + [{"role": "assistant", "content": reply.content},
                          {"role": "user", "content": plan.user_texts[turn]}]
    parts = _split_words(plan.tool_texts[turn], len(calls))
    return (history + [{"role": "assistant", "content": reply.content or None, "tool_calls": calls}]
            + [{"role": "tool", "tool_call_id": c["id"], "content": p} for c, p in zip(calls, parts)])


def _split_words(text: str, k: int) -> list[str]:
    """`text` in k parts of about equal word counts (each at least one word, when there are k)."""
    words = text.split()
    step = max(1, -(-len(words) // k))
    parts = [" ".join(words[i * step:(i + 1) * step]) for i in range(k)]
    return [p or "ok" for p in parts]

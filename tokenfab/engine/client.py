"""EngineClient: the one interface between the front end (server, Batch API, Ray ingress) and an engine.

The engine core is not thread-safe and runs on its own thread (engine/async_engine.py) or in other
processes (serve_ray/pool.py). What the front end may ask of it is declared here, and nothing else:

- requests: `add_request` returns a RequestStream of cumulative outputs (engine/streams.py); `abort`;
- input: `tokenizer` (chat templates, decoding), `tokenize` (a prompt checked against the vocabulary),
  `compile_structured` (a grammar compiled before the request is queued, so a bad schema is a 400);
- `info`: the model and the settings that do not change while it serves (ModelInfo);
- `stats()` (EngineStats: counters and gauges for /metrics) and `load()` (LoadSnapshot: the queue
  and the step-cost model, for SLO admission), both built on the engine's side after a step and read
  by the front end as plain data, as vLLM's stats loggers read theirs: a reader never waits for a step
  and never touches the scheduler, the block manager or the runner;
- life cycle and health: `start`, `stop`, `is_alive`, `dead_reason`, `degraded`.

This module imports only leaves (outputs, lanes, the grammar spec), so the server can import it without
the engine core.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from tokenfab.engine.lanes import is_long_prompt
from tokenfab.outputs import RequestOutput
from tokenfab.sampling import SamplingParams
from tokenfab.structured_output import StructuredOutputParams

if TYPE_CHECKING:
    from tokenfab.engine.streams import RequestStream


class EngineDeadError(RuntimeError):
    """The engine loop has stopped; no request can be served."""


class QueueFullError(RuntimeError):
    """Too many requests are waiting; the caller should shed this one (HTTP 429)."""


class RequestFailed(RuntimeError):
    """This request failed inside the engine; other requests are unaffected."""


class ReplicaLost(RequestFailed):
    """The replica running this request died after its output began: the request itself was fine, and
    sent again it runs on a live replica (HTTP 503 with Retry-After, not a 500)."""


class EngineListener(Protocol):
    """Receives timings for metrics, on the event loop."""
    def on_first_token(self, output: RequestOutput) -> None: ...
    def on_itl(self, gap_s: float, count: int) -> None: ...
    def on_finished(self, reason: str, output: RequestOutput | None) -> None: ...


@dataclass(slots=True)
class EngineStats:
    """Counters since start (monotonic) and gauges (now), for /metrics and benchmarks."""
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_blocks: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    prompt_tokens: int
    generation_tokens: int
    num_threads: int = 0                 # threads the steps run on now (the C kernels' pool's, above the cores)
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: tuple[int, ...] = ()   # [i]: drafts whose token i was accepted
    num_used_blocks: int = 0             # blocks held by live sequences (0 when idle), sliding pool included
    kv_touched_bytes: int = 0            # the KV pool's share ever used: resident pages (kv_cache.BlockManager.touched)
    # the disk tier (engine/kv_disk.py, DiskTierStats), 0 without one
    kv_disk_hit_blocks: int = 0
    kv_disk_hit_tokens: int = 0
    kv_disk_miss_blocks: int = 0
    kv_disk_bytes_written: int = 0
    kv_disk_bytes_read: int = 0
    kv_disk_skipped_files: int = 0
    kv_disk_dropped_saves: int = 0
    kv_disk_load_seconds: float = 0.0
    kv_disk_loads: int = 0
    kv_disk_bytes_used: int = 0


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """The served model and the engine settings that hold while it serves (built once, engine side)."""
    model_path: str | None
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...] = ()
    max_num_seqs: int = 1
    scheduling_policy: str = "fcfs"
    max_num_batched_tokens: int = 0          # a step's token budget
    batch_prefill_cap: int | None = None     # prefill tokens a step gives batch work (lanes.batch_prefill_cap)
    long_prompt_threshold: int | None = None     # prompts of at least this many tokens: the long lane
    config_labels: dict[str, str] = field(default_factory=dict)   # /metrics' tokenfab:config_info labels

    def is_long_prompt(self, num_prompt_tokens: int) -> bool:
        return is_long_prompt(num_prompt_tokens, self.long_prompt_threshold)


SLOT_HORIZON = 64              # running interactive sequences whose remaining steps a snapshot keeps


@dataclass(frozen=True, slots=True)
class QueueSnapshot:
    """The scheduler's queue at the end of a step, in the terms SLO admission predicts with."""
    time: float = 0.0
    interactive_prefill: int = 0       # prompt tokens of interactive sequences not yet computed
    decodes: int = 0                   # running sequences past their prefill (both classes)
    batch_decodes: int = 0             # of those, batch-class ones
    mean_context: float = 0.0
    batch_chunk: int = 0               # batch prefill tokens a step carries (capped by its lane)
    interactive_seqs: int = 0          # interactive sequences running or waiting: each holds or claims a slot
    max_num_seqs: int | None = None    # the scheduler's sequence cap (None: no cap)
    slot_free_steps: tuple[int, ...] = ()   # running interactive sequences' tokens left to max_tokens, ascending

    def slot_wait_steps(self) -> int:
        """Decode steps before a new interactive sequence gets a slot under max_num_seqs."""
        need = self.interactive_seqs + 1 - self.max_num_seqs if self.max_num_seqs else 0
        if need <= 0:
            return 0
        if not self.slot_free_steps:       # slots held by sequences still queued: no estimate, no wait
            return 0
        k = min(need, len(self.slot_free_steps))
        # Beyond the horizon, slots free in waves of the slowest known sequence.
        return self.slot_free_steps[k - 1] * math.ceil(need / k)


@dataclass(frozen=True, slots=True)
class LoadSnapshot:
    """The engine's load after its last step: the queue, and the step-cost model fitted online
    (`cost`, costmodel/online.py; None until enough steps ran). `step_budget` is a copy of the scheduler's
    step-time budget (engine/step_budget.py; None without one), so `bounded_time` can be asked of it
    off the engine thread."""
    queue: QueueSnapshot = QueueSnapshot()
    cost: Any = None                   # step_time(StepShape) -> seconds
    step_budget: Any = None


@runtime_checkable
class EngineClient(Protocol):
    """What the server, the Batch API and the Ray ingress call; AsyncEngine and ReplicaPoolEngine
    implement it. Called on the event loop, except `compile_structured` (blocking: call it in a thread)."""
    info: ModelInfo
    tokenizer: Any
    listener: EngineListener | None
    max_waiting_requests: int | None
    dead_reason: str | None

    # -- life cycle and health --------------------------------------------------------------------
    def start(self) -> None: ...
    async def stop(self, timeout: float = 10.0) -> None: ...
    @property
    def is_alive(self) -> bool: ...
    def degraded(self) -> str | None:
        """Why the engine serves at reduced capacity (a replica pool is empty), or None."""

    # -- input ------------------------------------------------------------------------------------
    def tokenize(self, prompt: str | list[int]) -> list[int]:
        """Prompt token ids; ValueError on an empty prompt or an id outside the vocabulary."""
    def compile_structured(self, spec: StructuredOutputParams) -> None:
        """Compile the grammar now (cached for add_request); ValueError when it does not compile."""

    # -- requests ---------------------------------------------------------------------------------
    async def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                          priority: int = 0, arrival_time: float | None = None,
                          service_class: str = "interactive") -> RequestStream:
        """Queue a request; EngineDeadError, QueueFullError, or ValueError (nothing was queued)."""
    def abort(self, request_id: str) -> None: ...
    @property
    def num_requests(self) -> int: ...
    def num_waiting(self) -> int: ...

    # -- what the engine reports ------------------------------------------------------------------
    def stats(self) -> EngineStats: ...
    def load(self) -> LoadSnapshot:
        """The latest LoadSnapshot; the first call turns them on (an empty one until a step has run)."""
    def cached_prompt_tokens(self, prompts: list[list[int]], n: int = 1) -> int:
        """Prompt tokens a prefix-cache hit would skip now (an estimate; 0 where it cannot be known)."""


def tokenize_prompt(tokenizer, vocab_size: int, prompt: str | list[int]) -> list[int]:
    """A prompt's token ids: text through the tokenizer, ids checked against the vocabulary."""
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("prompt is empty")
        return list(tokenizer(prompt).input_ids)
    if not isinstance(prompt, (list, tuple)) or not prompt:
        raise ValueError("prompt must be a non-empty string or a non-empty list of token ids")
    for t in prompt:
        if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size:
            raise ValueError(f"prompt token id {t!r} is not in [0, {vocab_size})")
    return list(prompt)

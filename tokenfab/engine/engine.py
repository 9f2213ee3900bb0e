"""LLMEngine: add requests, step, collect outputs. One `step()` = schedule -> run -> sample -> postprocess.

The offline `LLM`, the CLI and the server's AsyncEngine all drive this class.
"""
from __future__ import annotations

import functools
from dataclasses import fields
import logging
import time

import torch

from tokenfab.config import EngineConfig
from tokenfab.engine.client import EngineStats, tokenize_prompt
from tokenfab.engine.detokenizer import IncrementalDetokenizer
from tokenfab.engine import prompt_logprobs
from tokenfab.engine.kv_cache import BlockManager
from tokenfab.engine.kv_connector import KVConnector, KVConnectorBinding
from tokenfab.engine.kv_disk import DiskKVConnector, DiskTierStats
from tokenfab.engine.lanes import SERVICE_CLASSES
from tokenfab.engine.sampler import Sampler, SampleRow
from tokenfab.engine.scheduler import Scheduler
from tokenfab.engine.step_budget import StepBudget
from tokenfab.costmodel.online import OnlineStepModel
from tokenfab.engine.structured import GrammarCompiler
from tokenfab.engine.update import ModelOutput
from tokenfab.engine.sequence import Sequence, SequenceStatus
from tokenfab.engine.sliding_kv import SlidingBlocks
from tokenfab.engine.threads import ThreadController, free_cores
from tokenfab import kernels
from tokenfab.model.loader import LoadedModel
from tokenfab.outputs import CompletionOutput, RequestMetrics, RequestOutput
from tokenfab.sampling import SamplingParams
from tokenfab.worker.executor import UniProcExecutor

log = logging.getLogger("tokenfab.engine")


def _set_threads(cores: int, n: int) -> None:
    """The thread controller's count: torch's up to `cores`, the C kernels' pool all of it (above `cores`,
    oversubscribed on purpose: see engine/threads.py)."""
    torch.set_num_threads(min(n, cores))
    kernels.pool_threads(n if n > cores else 0)


def _from_worker(name: str, doc: str) -> property:
    """An attribute of rank 0's Worker, read through the engine (worker/worker.py builds it)."""
    return property(lambda self: getattr(self.executor.worker, name), doc=doc)


class LLMEngine:
    """The engine core: requests, the scheduler, sampling and outputs. Building and running the model is
    the executor's (worker/executor.py, distributed/executor.py for tensor parallelism): it runs one
    Worker per rank, which loads the model, sizes the KV pool, chooses kernels and allocates the cache."""

    model = _from_worker("model", "rank 0's model (its shard with tensor parallelism)")
    model_path = _from_worker("model_path", "the model files read")
    model_config = _from_worker("model_config", "the model's shape (model/config.py)")
    tokenizer = _from_worker("tokenizer", "the model's tokenizer")
    file_dtypes = _from_worker("file_dtypes", "tensor type name -> count, as stored in the file")
    dtype = _from_worker("dtype", "the compute dtype")
    kv_bytes_per_token = _from_worker("kv_bytes_per_token", "one token's KV bytes (the draft's included)")
    kv_pool_bytes = _from_worker("kv_pool_bytes", "the KV pool's reserved bytes")
    kv_sized_from = _from_worker("kv_sized_from", "why the KV pool has as many blocks as it has")
    kernel_report = _from_worker("kernel_report", "the kernels chosen (kernels/tuning.py)")
    float_budget_from = _from_worker("float_budget_from", "why float copies of quantized weights got their budget")
    memory = _from_worker("memory", "bytes by owner (worker/memory.memory_breakdown), RSS after load")

    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None, kv_connector: KVConnector | None = None):
        """`loaded`: model files already read by `load_model_files` (tests and tools reuse one read).
        `kv_connector`: where KV blocks are saved to and loaded from besides the pool (engine/kv_connector.py)."""
        config.validate()
        self.config = config
        spec_cfg = None
        if config.speculative_config is not None:
            from tokenfab.config import SpeculativeConfig
            spec_cfg = SpeculativeConfig.from_dict(config.speculative_config)
        if config.tensor_parallel_size > 1:     # rank 0 of a tensor-parallel group (tokenfab/distributed)
            from tokenfab.distributed.executor import TensorParallelExecutor as Executor
        else:
            Executor = UniProcExecutor
        self.executor = Executor(config, loaded, spec_cfg)
        worker, mcfg = self.executor.worker, self.model_config
        self.max_model_len, num_blocks = worker.max_model_len, worker.num_blocks
        sliding = None
        if worker.kv.sliding_blocks:    # the sliding-window layers' own pool (engine/sliding_kv.py)
            sliding = SlidingBlocks(worker.kv.sliding_blocks, config.block_size, mcfg.sliding_window, num_blocks)
        self.executor.init_kv_cache(sliding)
        self.runner = self.executor.runner
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching, sliding)
        self.step_cost = OnlineStepModel()     # step times, fitted online: the step budget and SLO admission read it
        budget = (StepBudget(self.step_cost, config.step_time_budget_ms / 1e3 if config.step_time_budget_ms else None,
                             config.step_time_slack, config.step_budget_min_tokens)
                  if config.enable_step_time_budget else None)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.enable_chunked_prefill, config.scheduling_policy, config.batch_prefill_share,
                                   config.long_prompt_threshold, config.max_long_prefill_tokens, budget,
                                   mcfg.eos_token_ids, self.max_model_len)
        self.eos_token_ids = list(mcfg.eos_token_ids)
        self.sampler = Sampler(self.eos_token_ids, mcfg.vocab_size)
        self.structured = GrammarCompiler(self.tokenizer, mcfg.vocab_size, self.eos_token_ids)
        self.spec = None      # engine/spec: speculative decoding, when configured
        if spec_cfg is not None:
            from tokenfab.engine.spec.decoder import SpecDecoder
            self.spec = SpecDecoder(spec_cfg, self.max_model_len, mcfg.vocab_size, self.model, self.runner,
                                    self.block_manager, worker.draft, eos_token_ids=self.eos_token_ids)
        self.requests: dict[str, list[Sequence]] = {}
        self.prompts: dict[str, str | None] = {}
        self.prompt_tokens_total = 0
        # step_observer(steps, start, end, busy), if set, sees every step: (cached tokens before, new
        # tokens) per scheduled sequence, perf_counter() at its start and end, and whether requests are
        # left to run (e.g. tokenfab.costmodel.measured.StepLog).
        self.step_observer = None
        self.errors: dict[str, str] = {}      # request id -> why it failed, until its output is returned
        # adapts the thread count while other processes take cores (engine/threads.py): torch's up to the
        # count it started with, the C kernels' own pool (tf_cols, kernels/csrc/pool.c) up to twice that
        threads = torch.get_num_threads()
        # small_batch_threads: small steps on fewer threads, set by the thread that steps (OpenMP's count is
        # per thread); it owns the count, so the controller is off
        self.small_batch_threads, self._full_threads = config.small_batch_threads or None, threads
        self.thread_controller = (ThreadController(threads, cores_free=free_cores,
                                                   max_over=threads if kernels.enabled() else 0,
                                                   set_threads=functools.partial(_set_threads, threads))
                                  if config.adaptive_threads and config.device == "cpu" and threads > 1
                                  and not self.small_batch_threads else None)
        if config.kv_disk_dir is not None:
            if kv_connector is not None:
                raise ValueError("give kv_disk_dir or a kv_connector, not both")
            kv_connector = DiskKVConnector(config.kv_disk_dir, config.kv_disk_bytes)
        self.kv_disk = kv_connector if isinstance(kv_connector, DiskKVConnector) else None
        self.kv_connector = (KVConnectorBinding(kv_connector, self.scheduler, self.runner, config, self.model_path)
                             if kv_connector is not None else None)

    def close(self) -> None:
        """Release what outlives the object by itself: tensor-parallel worker processes, the KV connector's
        threads (its queued saves finish first). Idempotent."""
        if self.kv_connector is not None:
            self.kv_connector.close()
        self.executor.close()

    # -- requests --------------------------------------------------------------------------
    def tokenize(self, prompt: str | list[int]) -> list[int]:
        return tokenize_prompt(self.tokenizer, self.model_config.vocab_size, prompt)

    def check_prompt_length(self, num_tokens: int) -> None:
        if num_tokens >= self.max_model_len:
            pool = self.block_manager.num_blocks * self.config.block_size
            why = f", limited by the KV pool of {pool} tokens" if self.max_model_len == pool else ""
            raise ValueError(f"prompt has {num_tokens} tokens but max_model_len is {self.max_model_len}{why} "
                             f"(at least one token must be left to generate)")

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                    priority: int = 0, arrival_time: float | None = None,
                    service_class: str = "interactive") -> list[int]:
        """Queue a request. Raises ValueError (changing nothing) on bad input. Returns the prompt ids.
        service_class: interactive | batch (engine/lanes.py)."""
        params = params or SamplingParams()
        if service_class not in SERVICE_CLASSES:
            raise ValueError(f"service_class must be one of {', '.join(SERVICE_CLASSES)}, got {service_class!r}")
        if not isinstance(params, SamplingParams):
            raise ValueError("sampling params must be a SamplingParams")
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        ids = self.tokenize(prompt)
        self.check_prompt_length(len(ids))
        bad = next((t for t in params.logit_bias or () if t >= self.model_config.vocab_size), None)
        if bad is not None:
            raise ValueError(f"logit_bias names token id {bad}, not in [0, {self.model_config.vocab_size})")
        room = self.max_model_len - len(ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        grammar = self.structured.compile(params.structured_output) if params.structured_output else None
        arrival = time.monotonic() if arrival_time is None else arrival_time
        seqs = []
        for i in range(params.n):
            seq = Sequence(request_id, i, ids, params, max_tokens, priority=priority, arrival_time=arrival,
                           service_class=service_class)
            if params.seed is not None:
                seq.generator = torch.Generator(device=self.config.device).manual_seed(params.seed + i)
            seq.detokenizer = IncrementalDetokenizer(self.tokenizer, ids, params)
            if grammar is not None:
                seq.grammar = grammar.matcher()
            seqs.append(seq)
        self.requests[request_id] = seqs
        self.prompts[request_id] = prompt if isinstance(prompt, str) else None
        self.prompt_tokens_total += len(ids)   # once per request, cached or not (as vLLM counts)
        for seq in seqs:
            self.scheduler.add(seq)
        return ids

    def abort_request(self, request_id: str) -> bool:
        """Stop a request now and free its blocks. Unknown or finished ids are ignored."""
        seqs = self.requests.pop(request_id, None)
        self.prompts.pop(request_id, None)
        self.errors.pop(request_id, None)
        if seqs is None:
            return False
        for seq in seqs:
            if not seq.status.finished:
                self.scheduler.remove(seq)
                seq.status = SequenceStatus.FINISHED_ABORTED
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def num_unfinished_requests(self) -> int:
        return len(self.requests)

    # -- the step: schedule -> execute -> update_from_output -------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one scheduled batch. Returns outputs of the requests that progressed or finished."""
        t_start = time.perf_counter()
        if self.spec is not None:
            self.spec.propose(self.scheduler.running)
        batch = self.scheduler.schedule()
        if not batch.seqs:
            return []
        shapes = [(s.num_computed_tokens, n) for s, n in zip(batch.seqs, batch.num_new_tokens)]
        num_tokens = batch.total_tokens
        if self.small_batch_threads:            # decided on the scheduled step: a prefill gets every thread
            want = self.small_batch_threads if num_tokens <= self.config.small_batch_tokens else self._full_threads
            if want != torch.get_num_threads():
                torch.set_num_threads(want)
        t_run = time.perf_counter()
        output, num_rows = self._execute(batch)
        if self.thread_controller is not None:
            self.thread_controller.observe(num_tokens, time.perf_counter() - t_run)
        update = self.scheduler.update_from_output(batch, output)
        if self.spec is not None:
            self.spec.after_update(seq for seq, _ in output.sampled)
        if self.kv_connector is not None:
            self.kv_connector.save_new_blocks()
        self.errors.update(update.errors)
        outputs = [self._request_output(rid) for rid in update.request_ids]
        t_end = time.perf_counter()
        self.step_cost.observe(shapes, t_end - t_start)
        if self.spec is not None and num_tokens == num_rows:   # decode rows only: the policy's measured costs
            self.spec.observe_step(len(output.sampled), num_rows - len(output.sampled), t_end - t_start)
        if self.step_observer is not None:
            self.step_observer(shapes, t_start, t_end, self.has_unfinished_requests())
        return outputs

    def _execute(self, batch) -> tuple[ModelOutput, int]:
        """Run the model on `batch` and sample: the step's tokens, and how many logits rows sampled."""
        if self.kv_connector is not None:
            self.kv_connector.load(batch.kv_loads)
        step = self.runner.prepare(batch)
        masks = self.structured.masks(step.sampling_seqs)   # structured output; overlaps the model if enabled
        logits = self.runner.execute(step)
        bitmask = masks.result() if masks else None
        num_rows = len(step.sampling_seqs) + sum(len(s.spec_tokens) for s in step.sampling_seqs)
        if self.spec is not None:           # several tokens per sequence
            sampled = self.spec.sample(self.sampler, logits[:num_rows], step.sampling_seqs, bitmask)
        else:
            rows = [SampleRow(s.params, s.prompt_token_ids, s.output_token_ids, s.generator) for s in step.sampling_seqs]
            sampled = [[t] for t in self.sampler(logits[:num_rows], rows, bitmask)] if rows else []
        if step.prompt_rows:
            self._record_prompt_logprobs(logits[num_rows:], step.prompt_rows)
        return ModelOutput(list(zip(step.sampling_seqs, sampled))), num_rows

    def _record_prompt_logprobs(self, logits: torch.Tensor, runs: list[tuple[Sequence, int, int]]) -> None:
        row = 0
        for seq, lo, hi in runs:
            assert lo == len(seq.prompt_logprobs), (lo, len(seq.prompt_logprobs))
            seq.prompt_logprobs.extend(prompt_logprobs.entries(
                logits[row:row + hi - lo], seq.prompt_token_ids[lo + 1:hi + 1], seq.params.prompt_logprobs,
                self.model_config.vocab_size))
            row += hi - lo

    def _request_output(self, request_id: str) -> RequestOutput:
        seqs = self.requests[request_id]
        finished = all(s.status.finished for s in seqs)
        outs = []
        for s in seqs:
            lps = s.logprobs if s.params.logprobs is not None else None
            cum = sum(d[t].logprob for d, t in zip(s.logprobs, s.output_token_ids)) if lps else None
            outs.append(CompletionOutput(s.index, s.detokenizer.text, s.output_token_ids, s.finish_reason,
                                         s.stop_reason, lps, cum))
        s0 = seqs[0]
        first_tok = min((s.first_token_time for s in seqs if s.first_token_time), default=None)
        out = RequestOutput(request_id, self.prompts.get(request_id), s0.prompt_token_ids, outs, finished,
                            num_cached_tokens=s0.num_cached_tokens,
                            prompt_logprobs=[None, *s0.prompt_logprobs] if s0.params.prompt_logprobs is not None else None,
                            metrics=RequestMetrics(s0.arrival_time, s0.scheduled_time, first_tok,
                                                   time.monotonic() if finished else None))
        if finished:
            del self.requests[request_id]
            self.prompts.pop(request_id, None)
            out.error = self.errors.pop(request_id, None)
        return out

    # -- introspection ---------------------------------------------------------------------
    def stats(self) -> EngineStats:
        bm = self.block_manager
        stats = EngineStats(len(self.scheduler.running), len(self.scheduler.waiting), bm.usage(), bm.num_blocks,
                            bm.prefix_queries, bm.prefix_hits, self.scheduler.num_preemptions,
                            self.prompt_tokens_total, self.scheduler.num_generation_tokens,
                            self.thread_controller.threads if self.thread_controller else torch.get_num_threads(),
                            num_used_blocks=bm.num_used_blocks(),
                            kv_touched_bytes=self.kv_pool_bytes * bm.num_touched // bm.num_blocks)
        if self.kv_disk is not None:
            for f in fields(DiskTierStats):
                setattr(stats, "kv_disk_" + f.name, getattr(self.kv_disk.stats, f.name))
        if self.spec is not None:
            s = self.spec.stats
            stats.spec_decode_num_drafts, stats.spec_decode_num_draft_tokens = s.num_drafts, s.num_draft_tokens
            stats.spec_decode_num_accepted_tokens = s.num_accepted_tokens
            stats.spec_decode_num_accepted_tokens_per_pos = tuple(s.accepted_per_pos)
        return stats

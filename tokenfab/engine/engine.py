"""LLMEngine: add requests, step, collect outputs. One `step()` = schedule -> run -> sample -> postprocess.

The offline `LLM`, the CLI and the server's AsyncEngine all drive this class.
"""
from __future__ import annotations

import time

import torch

from tokenfab.config import EngineConfig
from tokenfab.engine.client import EngineStats
from tokenfab.engine.input_processor import InputProcessor
from tokenfab.engine.kv_cache import BlockManager
from tokenfab.engine.kv_connector import KVConnector, KVConnectorBinding
from tokenfab.engine.kv_disk import DiskKVConnector, connector_for
from tokenfab.engine.output_processor import OutputProcessor
from tokenfab.engine.sampler import Sampler, SampleRow
from tokenfab.engine.scheduler import Scheduler
from tokenfab.costmodel.online import OnlineStepModel
from tokenfab.engine.structured import GrammarCompiler
from tokenfab.engine.update import ModelOutput
from tokenfab.engine.sequence import SequenceStatus
from tokenfab.engine.sliding_kv import SlidingBlocks
from tokenfab.engine.threads import engine_controller
from tokenfab.engine.worker_attributes import WorkerAttributes
from tokenfab.model.loader import LoadedModel
from tokenfab.outputs import RequestOutput
from tokenfab.sampling import SamplingParams
from tokenfab.worker.executor import UniProcExecutor

class LLMEngine(WorkerAttributes):
    """The engine core: requests, the scheduler, sampling and outputs. Building and running the model is
    the executor's (worker/executor.py, distributed/executor.py for tensor parallelism): it runs one
    Worker per rank, which loads the model, sizes the KV pool, chooses kernels and allocates the cache."""

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
        self.scheduler = Scheduler.from_config(self.block_manager, config, self.step_cost, mcfg.eos_token_ids,
                                               self.max_model_len)
        self.eos_token_ids = list(mcfg.eos_token_ids)
        self.sampler = Sampler(self.eos_token_ids, mcfg.vocab_size)
        self.structured = GrammarCompiler(self.tokenizer, mcfg.vocab_size, self.eos_token_ids)
        self.spec = None      # engine/spec: speculative decoding, when configured
        if spec_cfg is not None:
            from tokenfab.engine.spec.decoder import SpecDecoder
            self.spec = SpecDecoder(spec_cfg, self.max_model_len, mcfg.vocab_size, self.model, self.runner,
                                    self.block_manager, worker.draft, eos_token_ids=self.eos_token_ids)
        self.inputs = InputProcessor(self.tokenizer, mcfg.vocab_size, self.max_model_len,
                                     num_blocks * config.block_size, self.structured, config.device,
                                     None if config.enable_chunked_prefill else config.max_num_batched_tokens)
        self.outputs = OutputProcessor(mcfg.vocab_size)
        self.prompt_tokens_total = 0
        # step_observer(steps, start, end, busy), if set, sees every step: (cached tokens before, new
        # tokens) per scheduled sequence, perf_counter() at its start and end, and whether requests are
        # left to run (e.g. tokenfab.costmodel.measured.StepLog).
        self.step_observer = None
        # small_batch_threads: small steps on fewer threads, set by the thread that steps (OpenMP's count is
        # per thread); it owns the count, so the controller (engine/threads.py) is off
        threads = torch.get_num_threads()
        self.small_batch_threads, self._full_threads = config.small_batch_threads or None, threads
        self.thread_controller = engine_controller(config.adaptive_threads and not self.small_batch_threads,
                                                   config.device, threads)
        kv_connector = connector_for(config, kv_connector)      # --kv-disk-dir: the disk tier (engine/kv_disk.py)
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
        return self.inputs.tokenize(prompt)

    def check_prompt_length(self, num_tokens: int) -> None:
        self.inputs.check_prompt_length(num_tokens)

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                    priority: int = 0, arrival_time: float | None = None,
                    service_class: str = "interactive") -> list[int]:
        """Queue a request. Raises ValueError (changing nothing) on bad input. Returns the prompt ids.
        service_class: interactive | batch (engine/lanes.py)."""
        if request_id in self.outputs.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        ids, seqs = self.inputs.sequences(request_id, prompt, params, priority, arrival_time, service_class)
        self.outputs.add(request_id, prompt, seqs)
        self.prompt_tokens_total += len(ids)   # once per request, cached or not (as vLLM counts)
        for seq in seqs:
            self.scheduler.add(seq)
        return ids

    def abort_request(self, request_id: str) -> bool:
        """Stop a request now and free its blocks. Unknown or finished ids are ignored."""
        seqs = self.outputs.pop(request_id)
        if seqs is None:
            return False
        for seq in seqs:
            if not seq.status.finished:
                self.scheduler.remove(seq)
                seq.status = SequenceStatus.FINISHED_ABORTED
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self.outputs.requests)

    def num_unfinished_requests(self) -> int:
        return len(self.outputs.requests)

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
        self.outputs.errors.update(update.errors)
        outputs = [self.outputs.output(rid) for rid in update.request_ids]
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
            self.outputs.record_prompt_logprobs(logits[num_rows:], step.prompt_rows)
        return ModelOutput(list(zip(step.sampling_seqs, sampled))), num_rows

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
            self.kv_disk.stats.fill(stats)
        if self.spec is not None:
            self.spec.stats.fill(stats)
        return stats

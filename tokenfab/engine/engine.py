"""LLMEngine: add requests, step, collect outputs. One `step()` = schedule -> run -> sample -> postprocess.

The offline `LLM`, the CLI and the server's AsyncEngine all drive this class.
"""
from __future__ import annotations

import functools
import logging
import time

import torch

from tokenfab.config import EngineConfig
from tokenfab.engine.client import EngineStats, tokenize_prompt
from tokenfab.engine.detokenizer import IncrementalDetokenizer
from tokenfab.engine import prompt_logprobs
from tokenfab.engine.kv_cache import BlockManager
from tokenfab.engine.lanes import SERVICE_CLASSES
from tokenfab.engine.memory import float_copy_budget, process_rss, release_freed_memory
from tokenfab.engine.runner import ModelRunner
from tokenfab.engine.sampler import Sampler, SampleRow
from tokenfab.engine.scheduler import Scheduler
from tokenfab.engine.step_budget import StepBudget
from tokenfab.engine.step_cost import OnlineStepModel
from tokenfab.engine.structured import GrammarCompiler
from tokenfab.engine.sequence import Sequence, SequenceStatus
from tokenfab.engine.sliding_kv import SlidingBlocks, fit_blocks, pool_size, sliding_layer_share
from tokenfab.engine.threads import ThreadController, free_cores
from tokenfab import kernels
from tokenfab.kernels.tuning import select_kernels
from tokenfab.model.attention import kv_bytes_per_token, kv_cache_torch_dtype
from tokenfab.model.backends import bf16_prefill_rows, c_float16_pools
from tokenfab.model.layers import float_weight_releaser, pack_linears
from tokenfab.model.loader import LoadedModel, load_model_files
from tokenfab.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from tokenfab.quant.kernels import KERNEL_ALIASES
from tokenfab.quant.load import build_model
from tokenfab.sampling import SamplingParams

log = logging.getLogger("tokenfab.engine")


def _set_threads(cores: int, n: int) -> None:
    """The thread controller's count: torch's up to `cores`, the C kernels' pool all of it (above `cores`,
    oversubscribed on purpose: see engine/threads.py)."""
    torch.set_num_threads(min(n, cores))
    kernels.pool_threads(n if n > cores else 0)


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def available_memory(device: str) -> int:
    if device.startswith("cuda"):
        return torch.cuda.mem_get_info()[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 << 30


def kv_pool_blocks(config: EngineConfig, max_len: int, block_bytes: int, fit=None) -> tuple[int, str]:
    """How many KV blocks to reserve, and why: `num_kv_blocks`, else `kv_cache_memory_bytes`, else what
    `max_num_seqs` sequences of `max_len` tokens need when that is less than the free-memory share
    (`kv_cache_memory_fraction` of available, at most `kv_cache_memory_max`), else that share.
    `fit(bytes)`: blocks that fit in a budget (default: bytes // block_bytes; sliding_kv.fit_blocks)."""
    fit = fit or (lambda budget: budget // block_bytes)
    if config.num_kv_blocks:
        return config.num_kv_blocks, "num_kv_blocks"
    if config.kv_cache_memory_bytes:
        return fit(config.kv_cache_memory_bytes), "kv_cache_memory_bytes"
    share = fit(min(int(available_memory(config.device) * config.kv_cache_memory_fraction),
                    config.kv_cache_memory_max))
    need = config.max_num_seqs * -(-max_len // config.block_size)
    if need < share:
        return need, f"max_num_seqs {config.max_num_seqs} x max_model_len {max_len}"
    return share, (f"kv_cache_memory_fraction {config.kv_cache_memory_fraction:.0%} of available memory, "
                   f"at most kv_cache_memory_max {config.kv_cache_memory_max / 2**30:.3g} GiB")


def memory_breakdown(model: torch.nn.Module, float_copy_bytes: int, kv_bytes: int) -> dict[str, int]:
    """Bytes by owner: the weights as stored (quantized blocks, float tensors, kernels' packed
    layouts), the float copies of quantized weights the kernel table kept, and the KV pool."""
    seen: set[int] = set()
    weights = 0
    for t in list(model.parameters()) + list(model.buffers()):
        if t.data_ptr() not in seen and t.device.type != "meta":
            seen.add(t.data_ptr())
            weights += t.numel() * t.element_size()
    from tokenfab.kernels.linear import plan_linears
    for m in plan_linears(model):       # layouts the plans prepared (oneDNN, tf_qgemm, packed), not float copies
        for c in (m.plan.choices if m.plan else []):
            if not c.kernel.float_copy:
                for t in _tensors(c.state):
                    key = _storage_key(t)
                    if key not in seen:
                        seen.add(key)
                        weights += t.numel() * t.element_size()
    return {"weights": weights, "float_copies": float_copy_bytes, "kv_pool": kv_bytes,
            "total": weights + float_copy_bytes + kv_bytes}


def _storage_key(t: torch.Tensor) -> int:
    try:
        return t.data_ptr()
    except RuntimeError:      # oneDNN's packed weights are opaque tensors: no shared storage to find
        return id(t)


def _tensors(state) -> list[torch.Tensor]:
    if isinstance(state, torch.Tensor):
        return [state]
    if isinstance(state, (tuple, list)):
        return [t for s in state for t in _tensors(s)]
    return []


class LLMEngine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None):
        """`loaded`: model files already read by `load_model_files` (tests and tools reuse one read)."""
        config.validate()
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        files = loaded or load_model_files(config.model)
        self.model_path = files.path
        self.model_config = mcfg = files.config
        self.tokenizer = files.tokenizer
        self.file_dtypes = files.file_dtypes
        self.dtype = _DTYPES[config.dtype]
        max_len = config.max_model_len or mcfg.max_position_embeddings

        # int8: values plus a float32 scale per token and head (counted, so int8 holds ~1.9x bf16's tokens)
        kv_dtype = kv_cache_torch_dtype(config.kv_cache_dtype, self.dtype, c_float16_pools(
            config.attention_backend, config.device, mcfg.head_dim, config.tensor_parallel_size))
        self.kv_bytes_per_token = kv_bytes_per_token(mcfg, kv_dtype)
        spec_cfg = draft_files = None
        if config.speculative_config is not None:
            from tokenfab.engine.spec.config import SpeculativeConfig
            spec_cfg = SpeculativeConfig.from_dict(config.speculative_config)
            if spec_cfg.method == "draft":   # its KV pool shares the budget, block for block (spec/draft.py)
                from tokenfab.engine.spec.draft import draft_kv_bytes_per_token, load_draft_files
                draft_files = load_draft_files(spec_cfg.model, mcfg, self.tokenizer)
                self.kv_bytes_per_token += draft_kv_bytes_per_token(draft_files, kv_dtype)
        block_bytes = self.kv_bytes_per_token * config.block_size
        # Sliding-window layers (Gemma 3) keep only their window, in a pool of their own (engine/sliding_kv.py)
        n_sliding, n_layers = sliding_layer_share(mcfg)
        sliding_bytes, sliding_need, fit = 0, 0, None
        if n_sliding and config.sliding_window_pool and config.tensor_parallel_size == 1:
            sliding_bytes = kv_bytes_per_token(mcfg, kv_dtype) * config.block_size * n_sliding // n_layers
            sliding_need = pool_size(mcfg.sliding_window, config.block_size, config.max_num_seqs,
                                     config.max_num_batched_tokens, 1 << 62) - 1
            fit = lambda budget: fit_blocks(budget, block_bytes - sliding_bytes, sliding_bytes, sliding_need)  # noqa: E731
        num_blocks, self.kv_sized_from = kv_pool_blocks(config, max_len, block_bytes, fit)
        if num_blocks < 1:
            raise ValueError(f"kv_cache_memory_bytes is too small for one KV block ({block_bytes} bytes)")
        # A sequence must always fit alone, or preemption could never make progress.
        self.max_model_len = min(max_len, num_blocks * config.block_size)
        if self.max_model_len < max_len and config.max_model_len:
            log.warning("max_model_len %d lowered to %d: the KV pool holds only %d tokens",
                        max_len, self.max_model_len, num_blocks * config.block_size)

        tp = config.tensor_parallel_size
        if tp > 1:          # this process is rank 0 of a tensor-parallel group (tokenfab/distributed)
            from tokenfab.distributed.executor import prepare_rank0
            prepare_rank0(config)
        self.model = build_model(files, self.dtype, config.device, config.block_size, self.max_model_len + 1,
                                 config.quantization, tp=(0, tp))
        sliding = None
        kv_pool_bytes = num_blocks * block_bytes
        if sliding_bytes:
            sliding = SlidingBlocks(min(sliding_need, num_blocks) + 1, config.block_size, mcfg.sliding_window,
                                    num_blocks)
            kv_pool_bytes = num_blocks * (block_bytes - sliding_bytes) + sliding.num_blocks * sliding_bytes
        self.kv_pool_bytes = kv_pool_bytes
        self._choose_kernels(kv_dtype, kv_pool_bytes)
        del files
        if config.device == "cpu" and release_freed_memory():   # the load's float tensors, freed: hand back
            self.memory["rss_after_load"] = process_rss() or 0
            self.memory["rss_peak_load"] = process_rss("VmHWM") or 0
            log.info("memory: process RSS after load %.0f MiB (peak %.0f MiB)", self.memory["rss_after_load"] / 2**20,
                     self.memory["rss_peak_load"] / 2**20)
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching, sliding)
        self.step_cost = OnlineStepModel()     # step times, fitted online: the step budget and SLO admission read it
        budget = (StepBudget(self.step_cost, config.step_time_budget_ms / 1e3 if config.step_time_budget_ms else None,
                             config.step_time_slack, config.step_budget_min_tokens)
                  if config.enable_step_time_budget else None)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.enable_chunked_prefill, config.scheduling_policy, config.batch_prefill_share,
                                   config.long_prompt_threshold, config.max_long_prefill_tokens, budget)
        self.runner = ModelRunner(self.model, num_blocks, config.block_size, kv_dtype, config.device, sliding)
        if tp > 1:          # the other ranks load their shards and join; each step goes to them too
            from tokenfab.distributed.executor import TensorParallelRunner
            self.runner = TensorParallelRunner.start(config, self.model_path, self.runner, num_blocks,
                                                     self.max_model_len + 1)
        self.eos_token_ids = list(mcfg.eos_token_ids)
        self.sampler = Sampler(self.eos_token_ids, mcfg.vocab_size)
        self.structured = GrammarCompiler(self.tokenizer, mcfg.vocab_size, self.eos_token_ids)
        self.spec = None      # engine/spec: speculative decoding, when configured
        if spec_cfg is not None:
            from tokenfab.engine.spec.decoder import SpecDecoder
            draft = None
            if draft_files is not None:
                from tokenfab.engine.spec.draft import build_draft_model
                draft_model = build_draft_model(draft_files, config, self.dtype, kv_dtype, self.max_model_len + 1)
                draft = (draft_model, ModelRunner(draft_model, num_blocks, config.block_size, kv_dtype, config.device))
                del draft_files
            self.spec = SpecDecoder(spec_cfg, self.max_model_len, mcfg.vocab_size, self.model, self.runner,
                                    self.block_manager, draft, eos_token_ids=self.eos_token_ids)
        self.requests: dict[str, list[Sequence]] = {}
        self.prompts: dict[str, str | None] = {}
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        # step_observer(steps, start, end, busy), if set, sees every step: (cached tokens before, new
        # tokens) per scheduled sequence, perf_counter() at its start and end, and whether requests are
        # left to run (e.g. tokenfab.plan.step_table.StepLog).
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

    def _choose_kernels(self, kv_dtype: torch.dtype, kv_bytes: int) -> None:
        """Every linear's kernels (the measured table) and the attention backend, once."""
        config, model = self.config, self.model
        pack_linears(model)           # float linears behind the kernel seam (model/layers.py)
        float_budget, self.float_budget_from = 0, "float32 on the CPU only"  # float copies of quantized
        if config.device == "cpu" and self.dtype == torch.float32:          # weights, where the table says
            float_budget, self.float_budget_from = float_copy_budget(        # they pay (engine/memory.py)
                config, available_memory(config.device), kv_bytes)
        self.kernel_report = select_kernels(
            model, max_rows=config.max_num_batched_tokens, head_max_rows=config.max_num_seqs, head=model.lm_head,
            autotune=config.kernel_autotune and config.device == "cpu", dtype=self.dtype,
            force=KERNEL_ALIASES.get(config.linear_kernel, config.linear_kernel), float_copy_budget=float_budget,
            stack_rows=config.fused_decode_max_tokens if config.enable_fused_decode else 0,
            big_stack_rows=config.fused_decode_big_max_tokens if config.enable_fused_decode else 0,
            int8_activations=config.int8_activations, after_plan=float_weight_releaser(model))
        model.set_attention_backend(model.default_backend(
            config.attention_backend, kv_dtype, fused_decode=config.enable_fused_decode,
            fused_max_tokens=config.fused_decode_max_tokens, fused_big_max_tokens=config.fused_decode_big_max_tokens,
            bf16_prefill_rows=bf16_prefill_rows(model, config.prefill_attention_dtype),
            bf16_prefill_auto=config.prefill_attention_dtype == "auto",
            paged_prefill_max_context=config.paged_prefill_max_context))
        r = self.kernel_report
        log.info("kernels: attention %s; linears %s%s", model.attention_backend.name,
                 "; ".join(f"{k} x{r.layers[k]}: {v}" for k, v in r.plans.items()),
                 f" (measured in {r.measured_s:.1f} s)" if r.measured_s else "")
        self.memory = memory_breakdown(model, r.float_copy_bytes, kv_bytes)
        m = self.memory
        log.info("memory: KV pool %.0f MiB reserved (%d tokens, %s; pages become resident as blocks are used), "
                 "weights %.0f MiB, float copies of quantized weights %.0f MiB (budget %.0f MiB: %s)",
                 kv_bytes / 2**20, kv_bytes // self.kv_bytes_per_token, self.kv_sized_from,
                 m["weights"] / 2**20, m["float_copies"] / 2**20, float_budget / 2**20, self.float_budget_from)

    def close(self) -> None:
        """Release what outlives the object by itself: tensor-parallel worker processes. Idempotent."""
        close = getattr(self.runner, "close", None)
        if close is not None:
            close()

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

    # -- the step --------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one scheduled batch. Returns outputs of the requests that progressed or finished."""
        t_start = time.perf_counter()
        if self.spec is not None:
            self.spec.propose(self.scheduler.running)
        batch = self.scheduler.schedule()
        if not batch.seqs:
            return []
        shapes = [(s.num_computed_tokens, n) for s, n in zip(batch.seqs, batch.num_new_tokens)]
        now = time.monotonic()
        for seq in batch.seqs:
            if seq.scheduled_time is None:
                seq.scheduled_time = now
        num_tokens = batch.total_tokens
        if self.small_batch_threads:            # decided on the scheduled step: a prefill gets every thread
            want = self.small_batch_threads if num_tokens <= self.config.small_batch_tokens else self._full_threads
            if want != torch.get_num_threads():
                torch.set_num_threads(want)
        t_run = time.perf_counter()
        step = self.runner.prepare(batch)
        masks = self.structured.masks(step.sampling_seqs)   # structured output; overlaps the model if enabled
        logits = self.runner.execute(step)
        bitmask = masks.result() if masks else None
        num_rows = len(step.sampling_seqs) + sum(len(s.spec_tokens) for s in step.sampling_seqs)
        if self.spec is not None:           # several tokens per sequence
            sampled = self.spec.sample(self.sampler, logits[:num_rows], step.sampling_seqs, bitmask)
        else:
            rows = [SampleRow(s.params, s.prompt_token_ids, s.output_token_ids, s.generator) for s in step.sampling_seqs]
            sampled = self.sampler(logits[:num_rows], rows, bitmask) if rows else []
        if self.thread_controller is not None:
            self.thread_controller.observe(num_tokens, time.perf_counter() - t_run)
        if step.prompt_rows:
            self._record_prompt_logprobs(logits[num_rows:], step.prompt_rows)
        prompt_done = []
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            seq.num_computed_tokens += n - len(seq.spec_tokens)   # drafts count once accepted (spec.commit)
            self.block_manager.cache_full_blocks(seq)
            if seq.max_tokens == 0 and seq.num_computed_tokens == seq.num_tokens:
                prompt_done.append(seq)     # prompt only (max_tokens 0): scored, nothing to sample

        now = time.monotonic()
        touched: dict[str, None] = {}
        for seq, tok in zip(step.sampling_seqs, sampled):
            try:
                if self.spec is not None:
                    self.spec.commit(seq, tok, lambda s, t: self._append_token(s, t, now), self.block_manager)
                else:
                    self._append_token(seq, tok, now)
            except Exception as e:  # e.g. a tokenizer failure: end this sequence, not the batch
                log.exception("request %s failed in postprocessing", seq.request_id)
                self.errors[seq.request_id] = f"{type(e).__name__}: {e}"
                seq.status = SequenceStatus.FINISHED_ERROR
                self.scheduler.remove(seq)
            touched[seq.request_id] = None
        for seq in prompt_done:
            self._finish(seq, SequenceStatus.FINISHED_LENGTH, None)
            touched[seq.request_id] = None
        outputs = [self._request_output(rid) for rid in touched]
        t_end = time.perf_counter()
        self.step_cost.observe(shapes, t_end - t_start)
        if self.spec is not None and num_tokens == num_rows:   # decode rows only: the policy's measured costs
            self.spec.observe_step(len(step.sampling_seqs), num_rows - len(step.sampling_seqs), t_end - t_start)
        if self.step_observer is not None:
            self.step_observer(shapes, t_start, t_end, self.has_unfinished_requests())
        return outputs

    def _record_prompt_logprobs(self, logits: torch.Tensor, runs: list[tuple[Sequence, int, int]]) -> None:
        row = 0
        for seq, lo, hi in runs:
            assert lo == len(seq.prompt_logprobs), (lo, len(seq.prompt_logprobs))
            seq.prompt_logprobs.extend(prompt_logprobs.entries(
                logits[row:row + hi - lo], seq.prompt_token_ids[lo + 1:hi + 1], seq.params.prompt_logprobs,
                self.model_config.vocab_size))
            row += hi - lo

    def _append_token(self, seq: Sequence, tok, now: float) -> None:
        seq.token_ids.append(tok.token_id)
        self.generation_tokens_total += 1
        if seq.first_token_time is None:
            seq.first_token_time = now
        if tok.logprob is not None:
            entry = {tok.token_id: Logprob(tok.logprob)}
            for tid, lp in (tok.top_logprobs or {}).items():
                entry.setdefault(tid, Logprob(lp))
            seq.logprobs.append(entry)
        p, tid = seq.params, tok.token_id
        n_out = seq.num_output_tokens
        if n_out >= p.min_tokens and ((not p.ignore_eos and tid in self.eos_token_ids) or tid in p.stop_token_ids):
            # The stopping token's own text stays out of the output, as in vLLM.
            self._finish(seq, SequenceStatus.FINISHED_STOPPED, tid if tid in p.stop_token_ids else None)
            return
        if seq.grammar is not None and not seq.grammar.consume_token(tid):
            raise RuntimeError(f"token {tid} broke the structured-output grammar: {seq.grammar.get_error()}")
        _, stop_str = seq.detokenizer.step([tid])
        if stop_str is not None:
            self._finish(seq, SequenceStatus.FINISHED_STOPPED, stop_str)
        elif seq.grammar is not None and seq.grammar.is_stopped():
            # The grammar is complete and allows only EOS: end now rather than spend a step sampling it.
            self._finish(seq, SequenceStatus.FINISHED_STOPPED, None)
        elif n_out >= seq.max_tokens or seq.num_tokens >= self.max_model_len:
            self._finish(seq, SequenceStatus.FINISHED_LENGTH, None)

    def _finish(self, seq: Sequence, status: SequenceStatus, reason) -> None:
        if status is not SequenceStatus.FINISHED_STOPPED or not isinstance(reason, str):
            seq.detokenizer.finish()
        seq.status = status
        seq.stop_reason = reason
        self.scheduler.remove(seq)

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
                            self.prompt_tokens_total, self.generation_tokens_total,
                            self.thread_controller.threads if self.thread_controller else torch.get_num_threads())
        if self.spec is not None:
            s = self.spec.stats
            stats.spec_decode_num_drafts, stats.spec_decode_num_draft_tokens = s.num_drafts, s.num_draft_tokens
            stats.spec_decode_num_accepted_tokens = s.num_accepted_tokens
            stats.spec_decode_num_accepted_tokens_per_pos = tuple(s.accepted_per_pos)
        return stats

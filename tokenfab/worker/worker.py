"""Worker: one rank's model. It loads the model, sizes the KV pool, chooses the kernels and allocates
the KV cache; the engine core schedules and never touches the model itself.

Every rank runs this class. Rank 0 decides what every rank must agree on (`KVCacheSpec`: the KV
dtype, the number of blocks, the longest sequence) and the other ranks are given it, so their block
tables mean the same positions. Building is two calls, as in vLLM: the constructor loads, sizes,
builds and chooses kernels; `init_kv_cache` allocates the pool once the core has made its block map
for the sliding-window layers (engine/sliding_kv.py), which the runner reads each step.

    worker = Worker(config)                 # rank 0, one process: UniProcExecutor (executor.py)
    worker.init_kv_cache(sliding)
    logits = worker.runner.execute(worker.runner.prepare(batch))
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from tokenfab.kernels.select import select_kernels
from tokenfab.model.attention import kv_bytes_per_token, kv_cache_torch_dtype
from tokenfab.model.backends import bf16_prefill_rows, c_float16_pools
from tokenfab.model.layers import float_weight_releaser, pack_linears
from tokenfab.model.loader import LoadedModel, load_model_files
from tokenfab.quant.kernels import KERNEL_ALIASES
from tokenfab.quant.load import build_model
from tokenfab.worker.draft_model import build_draft_model, load_draft_files
from tokenfab.worker.kv_sizing import fit_blocks, kv_pool_blocks, pool_size, sliding_layer_share
from tokenfab.worker.memory import (available_memory, check_fits, float_copy_budget, memory_breakdown, process_rss,
                                    release_freed_memory)
from tokenfab.worker.model_runner import ModelRunner

log = logging.getLogger("tokenfab.worker")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    """What rank 0 decides and every rank allocates alike."""
    dtype: torch.dtype          # the pools' element type (torch.int8: the int8 cache)
    num_blocks: int
    max_model_len: int          # the longest sequence: the model's, lowered to what the pool holds
    sized_from: str             # why that many blocks (for the log and `tokenfab info`)
    sliding_blocks: int = 0     # the sliding-window layers' own pool, its zero block included (0: none)


class Worker:
    def __init__(self, config, rank: int = 0, loaded: LoadedModel | None = None, kv: KVCacheSpec | None = None,
                 device: str | None = None, speculative=None):
        """Load this rank's shard of `config.model` (or `loaded`: files already read), size the KV pool
        (rank 0; the other ranks get rank 0's `kv`), build the model and choose its kernels.
        `speculative`: the parsed speculative config (config.SpeculativeConfig); a draft model is loaded here."""
        self.config, self.rank = config, rank
        self.device = device or config.device
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        files = loaded or load_model_files(config.model)
        check_fits(files, DTYPES[config.dtype], config.quantization, self.device, config.tensor_parallel_size)
        self.model_path, self.model_config, self.tokenizer = files.path, files.config, files.tokenizer
        self.file_dtypes = files.file_dtypes
        self.dtype = DTYPES[config.dtype]
        self.num_speculative_tokens = speculative.num_speculative_tokens if speculative is not None else 0
        self._draft_files = None
        if speculative is not None and speculative.method == "draft":
            self._draft_files = load_draft_files(speculative.model, files.config, files.tokenizer)
        self.kv = kv or self._size_kv_cache()
        self.max_model_len = self.kv.max_model_len
        self.model = build_model(files, self.dtype, self.device, config.block_size, self.max_model_len + 1,
                                 config.quantization, tp=(rank, config.tensor_parallel_size))
        if kv is None:          # rank 0 sized the pool for the whole model
            self.kv_bytes_per_token = self._sizing_bytes_per_token
        else:                   # a worker rank counts its own KV heads
            self.kv_bytes_per_token = kv_bytes_per_token(self.model.config, kv.dtype)
            self.kv_pool_bytes = kv.num_blocks * config.block_size * self.kv_bytes_per_token
        self._choose_kernels()
        del files
        if config.device == "cpu" and release_freed_memory():   # the load's float tensors, freed: hand back
            self.memory["rss_after_load"] = process_rss() or 0
            self.memory["rss_peak_load"] = process_rss("VmHWM") or 0
            if rank == 0:
                log.info("memory: process RSS after load %.0f MiB (peak %.0f MiB)",
                         self.memory["rss_after_load"] / 2**20, self.memory["rss_peak_load"] / 2**20)
        self.runner: ModelRunner | None = None
        self.draft = None           # (draft model, its runner) with a draft model

    @property
    def num_blocks(self) -> int:
        return self.kv.num_blocks

    @property
    def kv_sized_from(self) -> str:
        return self.kv.sized_from

    def _size_kv_cache(self) -> KVCacheSpec:
        """Rank 0: the KV dtype, once, and how many blocks the budget holds (worker/kv_sizing.py)."""
        config, mcfg = self.config, self.model_config
        max_len = config.max_model_len or mcfg.max_position_embeddings
        # int8: values plus a float32 scale per token and head (counted, so int8 holds ~1.9x bf16's tokens)
        kv_dtype = kv_cache_torch_dtype(config.kv_cache_dtype, self.dtype, c_float16_pools(
            config.attention_backend, config.device, mcfg.head_dim, config.tensor_parallel_size))
        per_token = kv_bytes_per_token(mcfg, kv_dtype)
        if self._draft_files is not None:   # its KV pool shares the budget, block for block (spec/draft.py)
            per_token += kv_bytes_per_token(self._draft_files.config, kv_dtype)
        self._sizing_bytes_per_token = per_token
        block_bytes = per_token * config.block_size
        # Sliding-window layers (Gemma 3) keep only their window, in a pool of their own (engine/sliding_kv.py)
        n_sliding, n_layers = sliding_layer_share(mcfg)
        sliding_bytes, sliding_need, fit = 0, 0, None
        if n_sliding and config.sliding_window_pool and config.tensor_parallel_size == 1:
            sliding_bytes = kv_bytes_per_token(mcfg, kv_dtype) * config.block_size * n_sliding // n_layers
            sliding_need = pool_size(mcfg.sliding_window, config.block_size, config.max_num_seqs,
                                     config.max_num_batched_tokens, 1 << 62) - 1
            fit = lambda budget: fit_blocks(budget, block_bytes - sliding_bytes, sliding_bytes, sliding_need)  # noqa: E731
        num_blocks, sized_from = kv_pool_blocks(config, max_len, block_bytes, fit)
        if num_blocks < 1:
            raise ValueError(f"kv_cache_memory_bytes is too small for one KV block ({block_bytes} bytes)")
        # A sequence must always fit alone, or preemption could never make progress.
        max_model_len = min(max_len, num_blocks * config.block_size)
        if max_model_len < max_len and config.max_model_len:
            log.warning("max_model_len %d lowered to %d: the KV pool holds only %d tokens",
                        max_len, max_model_len, num_blocks * config.block_size)
        # Without chunked prefill a prompt, or a preempted sequence's recompute, runs in one step: a longer
        # one would wait for a step that never comes.
        if not config.enable_chunked_prefill and config.max_num_batched_tokens < max_model_len:
            if config.max_model_len:
                log.warning("max_model_len %d lowered to %d: chunked prefill is off and a step holds at most "
                            "max_num_batched_tokens", max_model_len, config.max_num_batched_tokens)
            max_model_len = config.max_num_batched_tokens
        self.kv_pool_bytes = num_blocks * block_bytes
        sliding_blocks = 0
        if sliding_bytes:
            sliding_blocks = min(sliding_need, num_blocks) + 1
            self.kv_pool_bytes = num_blocks * (block_bytes - sliding_bytes) + sliding_blocks * sliding_bytes
        return KVCacheSpec(kv_dtype, num_blocks, max_model_len, sized_from, sliding_blocks)

    def _choose_kernels(self) -> None:
        """Every linear's kernels (the measured table) and the attention backend, once."""
        config, model, kv_bytes = self.config, self.model, self.kv_pool_bytes
        pack_linears(model)           # float linears behind the kernel seam (model/layers.py)
        float_budget, self.float_budget_from = 0, "float32 on the CPU only"  # float copies of quantized
        if config.device == "cpu" and self.dtype == torch.float32:          # weights, where the table says
            float_budget, self.float_budget_from = float_copy_budget(        # they pay (worker/memory.py)
                config, available_memory(config.device), kv_bytes, self.num_speculative_tokens)
        self.kernel_report = select_kernels(
            model, max_rows=config.max_num_batched_tokens, head_max_rows=config.max_num_seqs, head=model.lm_head,
            autotune=config.kernel_autotune and config.device == "cpu", dtype=self.dtype,
            force=KERNEL_ALIASES.get(config.linear_kernel, config.linear_kernel), float_copy_budget=float_budget,
            stack_rows=config.fused_decode_max_tokens if config.enable_fused_decode else 0,
            big_stack_rows=config.fused_decode_big_max_tokens if config.enable_fused_decode else 0,
            int8_activations=config.int8_activations, after_plan=float_weight_releaser(model))
        model.set_attention_backend(model.default_backend(
            config.attention_backend, self.kv.dtype, fused_decode=config.enable_fused_decode,
            fused_max_tokens=config.fused_decode_max_tokens, fused_big_max_tokens=config.fused_decode_big_max_tokens,
            bf16_prefill_rows=bf16_prefill_rows(model, config.prefill_attention_dtype),
            bf16_prefill_auto=config.prefill_attention_dtype == "auto",
            paged_prefill_max_context=config.paged_prefill_max_context))
        r = self.kernel_report
        self.memory = m = memory_breakdown(model, r.float_copy_bytes, kv_bytes)
        if self.rank:
            return
        log.info("kernels: attention %s; linears %s%s", model.attention_backend.name,
                 "; ".join(f"{k} x{r.layers[k]}: {v}" for k, v in r.plans.items()),
                 f" (measured in {r.measured_s:.1f} s)" if r.measured_s else "")
        log.info("memory: KV pool %.0f MiB reserved (%d tokens, %s; pages become resident as blocks are used), "
                 "weights %.0f MiB, float copies of quantized weights %.0f MiB (budget %.0f MiB: %s)",
                 kv_bytes / 2**20, kv_bytes // self.kv_bytes_per_token, self.kv.sized_from,
                 m["weights"] / 2**20, m["float_copies"] / 2**20, float_budget / 2**20, self.float_budget_from)

    def init_kv_cache(self, sliding=None) -> ModelRunner:
        """Allocate the KV pool (its pages become resident as blocks are used) and the runner over it.
        `sliding`: the core's sliding block map when `kv.sliding_blocks` (engine/sliding_kv.SlidingBlocks)."""
        assert self.runner is None, "the KV cache is allocated once"
        assert (sliding is not None) == bool(self.kv.sliding_blocks), "the sliding pool needs the core's block map"
        config, kv = self.config, self.kv
        self.runner = ModelRunner(self.model, kv.num_blocks, config.block_size, kv.dtype, self.device, sliding)
        if self._draft_files is not None:
            draft_model = build_draft_model(self._draft_files, config, self.dtype, kv.dtype, self.max_model_len + 1)
            self.draft = (draft_model, ModelRunner(draft_model, kv.num_blocks, config.block_size, kv.dtype,
                                                   self.device))
            self._draft_files = None
        return self.runner

    def execute(self, step):
        """One forward over this rank's shard: the logits rows `step` asks for."""
        return self.runner.execute(step)

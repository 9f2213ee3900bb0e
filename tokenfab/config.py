"""Every engine knob in one place, named as vLLM names them where the meaning is the same.

`LLM(...)`, the CLI flags and the server all map onto these fields. This module imports only leaves:
names that other parts implement (quantization methods, attention backends, linear kernels) are checked
against tokenfab.registry, which those parts fill.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path

from tokenfab import registry

DEFAULT_SMALL_BATCH_TOKENS = 4
RENAMED = {"kv_cache_memory": "kv_cache_memory_bytes"}     # earlier names still accepted: old -> new


@dataclass(slots=True)
class EngineConfig:
    model: str | None = None                 # GGUF file or HF folder; None: the bundled SmolLM2-135M-Instruct
    dtype: str = "float32"                   # float32 | bfloat16 (compute and KV dtype for float models)
    device: str = "cpu"                      # cpu | cuda
    max_model_len: int | None = None         # None: the model's context length
    max_num_seqs: int = 64                   # sequences per step
    max_num_batched_tokens: int = 2048       # token budget per step (prefill chunks + decodes)
    block_size: int = 16                     # tokens per KV block
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    kv_cache_memory_bytes: int | None = None  # bytes for the KV pool (vLLM's name; on CPU VLLM_CPU_KVCACHE_SPACE;
                                             # kv_cache_memory before 2026-12); None: what max_num_seqs x
                                             # max_model_len needs, capped by the two knobs below
    kv_cache_memory_fraction: float = 0.2    # ... at most this share of available memory (cf. vLLM's
                                             # gpu_memory_utilization, but for the KV pool alone)
    kv_cache_memory_max: int = 4 << 30       # ... and at most this many bytes
    num_kv_blocks: int | None = None         # exact pool size (overrides kv_cache_memory_bytes); mostly for tests
    sliding_window_pool: bool = True         # sliding-window layers (Gemma 3) keep only their window's blocks,
                                             # in a smaller pool of their own (engine/sliding_kv.py); False:
                                             # every layer keeps every position (single-process only)
    kv_cache_dtype: str = "auto"             # auto | float32 | float16 (half the bytes decode attention reads) | int8;
                                             # auto: float16 where the cpu backend's C kernels read it, else = dtype
    kv_disk_dir: str | None = None           # the disk tier: full prefix blocks saved here, one file each, and loaded
                                             # back on a prefix hit, also after a restart (engine/kv_disk.py); None: off
    kv_disk_bytes: int = 4 << 30             # ... at most this many bytes of block files, least recently used deleted
    quantization: str = "auto"               # auto | none (float) | gguf (blocks as shipped) | int8 | int4[-g32|-g64|-g128]
    scheduling_policy: str = "fcfs"          # fcfs | priority
    batch_prefill_share: float = 0.25        # most of a step's token budget batch-class prefills may take (engine/lanes.py)
    long_prompt_threshold: int | None = None  # prompts of at least this many tokens prefill in their own lane
    max_long_prefill_tokens: int = 512       # that lane's prefill tokens per step
    # -- step-time budget for batch rows and long-prompt prefill (engine/step_budget.py) -------------------
    enable_step_time_budget: bool = True     # size them with the online step model so interactive steps stay fast
    step_time_budget_ms: float | None = None  # a step's time limit with them in it; serve --slo-tpot-ms sets it;
                                             # None: relative, (1 + step_time_slack) x the interactive work's time
    step_time_slack: float = 0.05            # ... fill may add 5 % of one decode step to an interactive decode step
                                             # (plus unused credit), and a step without interactive work may run 5 %
                                             # longer than the P90 interactive one. 0.2 and 0.1 measured P99 TPOT
                                             # 1.7x beside a batch job; 0.05 0.95-0.99x with batch at 109-126 % of
                                             # the idle capacity (benchmarks/mixed_load.py, docs/batch.md)
    step_budget_min_tokens: int = 1          # fill tokens per step over the limit when no interactive prompt
                                             # waits or prefills, so batch work never starves
    seed: int = 0
    num_threads: int | None = None           # torch intra-op threads; None: torch's default
    # -- kernels: chosen once at load (tokenfab/kernels/linear.py, tokenfab/model/backends.py) ----------
    attention_backend: str = "auto"          # auto | torch (portable) | cpu (tokenfab's C kernels)
    linear_kernel: str = "auto"              # auto (measured table) | a registered kernel forced where it runs:
                                             # onednn, torch, qgemm, qmadd, qdot, qtile, qbf16, packed, float,
                                             # bf16, dequant, w8a8
    kernel_autotune: bool = True             # measure the kernel table on first load (cached per CPU); False:
                                             # the built-in rules, nothing measured
    int8_activations: bool = False           # let the table choose qdot (int8 activation blocks, llama.cpp's
                                             # approach): KL 3.5e-3 vs float on the bundled model (docs/quant.md)
    enable_float_cache: bool = True          # float32 copies of quantized weights where the table says they pay
    float_cache_memory: int | None = None    # bytes those copies may take; None: auto, i.e. only when decode steps
                                             # outgrow tf_qgemm's rows (max_num_seqs x (1 + drafts) > 16), then
                                             # float_cache_memory_fraction of available memory less what the KV
                                             # pool takes beyond its own fraction; 0: none (docs/architecture.md)
    float_cache_memory_fraction: float = 0.25
    prefill_attention_dtype: str = "auto"    # prefill (and chunk) attention on the cpu backend: float32 |
                                             # bfloat16 (AMX / AVX512-BF16 SDPA, 2.2x faster at 512 tokens, lossy) |
                                             # auto: bfloat16 on a CPU with bf16 units from the row count where the
                                             # qkv projection already runs a bf16-activation kernel (bf16, qbf16), else float32
    paged_prefill_max_context: int = 128     # cpu backend: prefill chunks whose context (cached + new tokens) is at
                                             # most this many tokens attend through the paged decode kernel, every
                                             # token a row reading the pools in place, float32 (1.05-1.14x a prefill
                                             # step of 32-128-token prompts, even at 160, 0.9x at 192-512 against
                                             # bf16 SDPA: docs/architecture.md); 0: never
    enable_fused_decode: bool = True         # cpu backend: the whole stack in one C call on small decode steps
    fused_decode_max_tokens: int = 16        # ... of at most this many rows (and where every linear runs qgemm)
    fused_decode_big_max_tokens: int = 64    # ... and bigger decode steps up to this many rows where every linear's
                                             # plan keeps reading its qtile layout (qtile, then qbf16); 0: never
    small_batch_threads: int | None = None   # threads for steps of at most small_batch_tokens tokens (small
                                             # decodes; llama.cpp's --threads beside --threads-batch), the rest
                                             # on all; None or 0: all threads always (the thread controller owns
                                             # the count then; with this set it is off)
    small_batch_tokens: int = DEFAULT_SMALL_BATCH_TOKENS   # ... steps this small
    adaptive_threads: bool = True            # lower the thread count while other processes take cores, restore
                                             # it after (tokenfab/engine/threads.py; CPU, 2+ threads)
    tensor_parallel_size: int = 1            # ranks one model is split over (torch.distributed); docs/tensor_parallel.md
    distributed_executor_backend: str | None = None   # how those ranks start: mp | ray; None: Ray actors inside
                                             # a Ray actor (serve --replicas), else torch.multiprocessing
    tp_allreduce: str = "auto"               # how CPU ranks add their partial sums: shm (a shared buffer) |
                                             # gloo | auto: shm for local processes on x86-64, else gloo;
                                             # CUDA always uses NCCL (docs/tensor_parallel.md)
    speculative_config: dict | None = None   # e.g. {"method": "ngram", "num_speculative_tokens": 4}; docs/speculative.md

    @classmethod
    def from_kwargs(cls, **kwargs) -> "EngineConfig":
        for old, new in RENAMED.items():
            if old in kwargs:
                if new in kwargs:
                    raise ValueError(f"{old} is the earlier name of {new}: give one of them")
                kwargs[new] = kwargs.pop(old)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"unknown engine option(s) {unknown}; known: {sorted(known)}")
        return cls(**kwargs)

    def validate(self) -> None:
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "tensor_parallel_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if self.distributed_executor_backend not in (None, "mp", "ray"):
            raise ValueError(f"distributed_executor_backend must be mp or ray, got {self.distributed_executor_backend!r}")
        if self.tp_allreduce not in ("auto", "shm", "gloo"):
            raise ValueError(f"tp_allreduce must be auto, shm or gloo, got {self.tp_allreduce!r}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be positive, got {self.max_model_len}")
        if self.kv_cache_dtype not in ("auto", "float32", "float16", "int8"):
            raise ValueError(f"kv_cache_dtype must be auto, float32, float16 or int8, got {self.kv_cache_dtype!r}")
        self._validate_kv_disk()
        for name in ("quantization", "attention_backend", "linear_kernel"):    # names the parts register
            registry.check(name, getattr(self, name))
        if self.prefill_attention_dtype not in ("auto", "float32", "bfloat16"):
            raise ValueError(f"prefill_attention_dtype must be auto, float32 or bfloat16, "
                             f"got {self.prefill_attention_dtype!r}")
        for name in ("fused_decode_max_tokens", "small_batch_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        v = self.small_batch_threads
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
            raise ValueError(f"small_batch_threads must be 0 (off) or a positive number of threads, got {v!r}")
        for name in ("fused_decode_big_max_tokens", "paged_prefill_max_context"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"{name} must be a non-negative integer, got {v!r}")
        for name in ("kv_cache_memory_fraction", "float_cache_memory_fraction"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not 0 <= v <= 1:
                raise ValueError(f"{name} must be a fraction in [0, 1], got {v!r}")
        if not isinstance(self.kv_cache_memory_max, int) or self.kv_cache_memory_max < 1:
            raise ValueError(f"kv_cache_memory_max must be a positive number of bytes, got {self.kv_cache_memory_max!r}")
        if self.float_cache_memory is not None and (not isinstance(self.float_cache_memory, int)
                                                    or self.float_cache_memory < 0):
            raise ValueError(f"float_cache_memory must be a number of bytes (0: no float copies), "
                             f"got {self.float_cache_memory!r}")
        if not 0 < self.batch_prefill_share <= 1:
            raise ValueError(f"batch_prefill_share must be in (0, 1], got {self.batch_prefill_share}")
        if self.long_prompt_threshold is not None and self.long_prompt_threshold < 2:
            raise ValueError(f"long_prompt_threshold must be at least 2 tokens, got {self.long_prompt_threshold}")
        if self.max_long_prefill_tokens < 1:
            raise ValueError(f"max_long_prefill_tokens must be positive, got {self.max_long_prefill_tokens}")
        if self.step_time_budget_ms is not None and not self.step_time_budget_ms > 0:
            raise ValueError(f"step_time_budget_ms must be positive, got {self.step_time_budget_ms}")
        if not isinstance(self.step_time_slack, (int, float)) or not self.step_time_slack >= 0:
            raise ValueError(f"step_time_slack must be a non-negative fraction, got {self.step_time_slack!r}")
        if not isinstance(self.step_budget_min_tokens, int) or self.step_budget_min_tokens < 0:
            raise ValueError(f"step_budget_min_tokens must be a non-negative integer, got {self.step_budget_min_tokens!r}")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be fcfs or priority, got {self.scheduling_policy!r}")
        SpeculativeConfig.from_dict(self.speculative_config)


    def _validate_kv_disk(self) -> None:
        v = self.kv_disk_bytes
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"kv_disk_bytes must be a positive number of bytes, got {v!r}")
        if self.kv_disk_dir is None:
            return
        d = Path(self.kv_disk_dir).expanduser()
        if not d.parent.is_dir():
            raise ValueError(f"kv_disk_dir {self.kv_disk_dir!r}: its parent {str(d.parent)!r} does not exist "
                             f"(the directory itself is made when missing)")
        if d.exists() and not d.is_dir():
            raise ValueError(f"kv_disk_dir {self.kv_disk_dir!r} is a file, not a directory")
        if not self.enable_prefix_caching:
            raise ValueError("kv_disk_dir needs enable_prefix_caching: the disk tier's keys are the prefix cache's hashes")
        if self.tensor_parallel_size != 1:
            raise ValueError(f"kv_disk_dir needs one KV pool in one process, not tensor_parallel_size "
                             f"{self.tensor_parallel_size}")


METHODS = ("ngram", "draft", "layerskip")


@dataclass(slots=True)
class SpeculativeConfig:
    """`EngineConfig.speculative_config` (a dict, as vLLM takes it), validated (engine/spec/ runs it):

        LLM(speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                "prompt_lookup_max": 4, "prompt_lookup_min": 2})
        LLM(speculative_config={"method": "layerskip", "num_speculative_tokens": 3, "num_layers": 20})
        LLM(speculative_config={"method": "draft", "model": "path/to/small.gguf", "num_speculative_tokens": 4})
        tokenfab serve --speculative-config '{"method": "ngram", "num_speculative_tokens": 4}'
    """
    method: str = "ngram"
    num_speculative_tokens: int = 4       # k: the most draft tokens per sequence and step
    prompt_lookup_max: int = 4            # ngram: the longest suffix matched against the context
    prompt_lookup_min: int = 2            # ngram: the shortest
    num_layers: int | None = None         # layerskip: the target's first L layers draft; None: 0.8 of them (24 of 30; docs/speculative.md)
    model: str | None = None              # draft: the draft model (GGUF file or HF folder), same vocabulary
    # Adaptive policy (docs/speculative.md). The batch switch: no speculation in a step whose
    # running decodes exceed this. Measured (benchmarks/speculative.py, 1 thread): at 8 streams a
    # 16-row verification step cost 2.0x a decode step for 1.9x the tokens; at 4 streams, 2.5x for
    # up to 3.9x.
    max_batch_size: int = 4
    # Rows (decodes + drafts) a step with drafts may have: 16 keeps it on the one-call C decode stack
    # (kernels.QGEMM_MAX_ROWS); drafts beyond it are not proposed.
    max_step_rows: int = 16
    adaptive: bool = True                 # k per sequence from its recent acceptance; back-off when it keeps rejecting

    @classmethod
    def from_dict(cls, d: dict | None) -> "SpeculativeConfig | None":
        if d is None:
            return None
        if isinstance(d, SpeculativeConfig):
            return d
        if not isinstance(d, dict):
            raise ValueError(f"speculative_config must be a dict like {{\"method\": \"ngram\", "
                             f"\"num_speculative_tokens\": 4}}, got {d!r}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown speculative_config key(s) {unknown}; known: {sorted(known)}")
        if "method" not in d:
            raise ValueError(f"speculative_config needs a method, one of {', '.join(METHODS)}")
        cfg = cls(**d)
        cfg.validate()
        return cfg

    def validate(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative_config method must be one of {', '.join(METHODS)}, got {self.method!r}")
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "max_batch_size",
                     "max_step_rows", "num_layers"):
            v = getattr(self, name)
            if v is None and name == "num_layers":
                continue
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"speculative_config {name} must be a positive integer, got {v!r}")
        if self.method == "draft" and not (isinstance(self.model, str) and self.model):
            raise ValueError("speculative_config method 'draft' needs \"model\": the path of a smaller model "
                             "(GGUF file or HF folder) with the target's tokenizer")
        if self.model is not None and self.method != "draft":
            raise ValueError(f"speculative_config model is for method 'draft', not {self.method!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config prompt_lookup_min ({self.prompt_lookup_min}) must be <= "
                             f"prompt_lookup_max ({self.prompt_lookup_max})")
        if self.num_speculative_tokens > 32:
            raise ValueError(f"speculative_config num_speculative_tokens must be at most 32, got {self.num_speculative_tokens}")

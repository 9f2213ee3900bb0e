"""Engine flags for every command that runs the engine (`serve`, `generate`, `chat`), in one place.

Each flag is an `EngineConfig` field under vLLM's flag name (`--max-model-len`, `--max-num-seqs`, ...).
A flag left out keeps the dataclass default, so `EngineConfig` stays the single source of defaults:

    add_engine_args(parser)                   # adds MODEL (positional, optional) and the engine flags
    config = engine_config_from_args(args)    # -> EngineConfig, validated

Importing this module does not import torch (the CLI must register parsers cheaply).
"""
from __future__ import annotations

import argparse
import json
import re
from dataclasses import fields

from tokenfab.config import EngineConfig

_SIZE_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
               "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "t": 10**12, "tb": 10**12}


def parse_size(text: str) -> int:
    """Bytes from '536870912', '512MiB', '2GB' or '1.5g' (decimal units for kB/MB/GB, binary for KiB/MiB/GiB)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _SIZE_UNITS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size; use bytes or a unit, e.g. 512MiB or 2GB")
    value = int(float(m.group(1)) * _SIZE_UNITS[unit])
    if value < 1:
        raise argparse.ArgumentTypeError(f"size {text!r} must be at least 1 byte")
    return value


def _size_or_zero(text: str) -> int:
    return 0 if str(text).strip() == "0" else parse_size(text)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be a positive integer")
    return value


def _json_dict(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object like '{{\"method\": \"ngram\"}}', got {text!r}")
    return value


def add_engine_args(parser: argparse.ArgumentParser, *, positional_model: bool = True,
                    exclude: tuple[str, ...] = ()) -> None:
    """Add MODEL and the engine flags. With positional_model=False the model is `--model` instead.

    `exclude` names fields whose flag the command defines itself (e.g. ("seed",) where --seed is a
    per-request sampling seed); those fields keep their EngineConfig default."""
    d = EngineConfig()
    # A command may define one of these flags itself after this call (e.g. `generate` has a per-request
    # --seed); its definition then wins instead of argparse refusing the whole CLI. Groups made later
    # inherit the parser's handler; the existing ones (incl. the default "options") are set here.
    for container in (parser, *getattr(parser, "_action_groups", ())):
        container.conflict_handler = "resolve"
    if positional_model:
        parser.add_argument("model", nargs="?", default=None, metavar="MODEL",
                            help="a .gguf file or an HF model folder (default: the bundled SmolLM2-135M-Instruct)")
    else:
        parser.add_argument("--model", default=None,
                            help="a .gguf file or an HF model folder (default: the bundled SmolLM2-135M-Instruct)")
    g = _Group(parser.add_argument_group("engine"), {f"--{name.replace('_', '-')}" for name in exclude})
    g.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                   help=f"compute dtype for float weights (default: {d.dtype})")
    g.add_argument("--device", default=None, help=f"cpu or cuda (default: {d.device})")
    g.add_argument("--max-model-len", type=_positive_int, default=None,
                   help="longest prompt + output in tokens (default: the model's context length, "
                        "capped by what the KV pool holds)")
    g.add_argument("--max-num-seqs", type=_positive_int, default=None,
                   help=f"sequences per step (default: {d.max_num_seqs})")
    g.add_argument("--max-num-batched-tokens", type=_positive_int, default=None,
                   help=f"token budget per step, prefill chunks + decodes (default: {d.max_num_batched_tokens})")
    g.add_argument("--block-size", type=_positive_int, default=None,
                   help=f"tokens per KV block (default: {d.block_size})")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                   help=f"reuse KV blocks of shared prompt prefixes (default: {'on' if d.enable_prefix_caching else 'off'})")
    g.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=None,
                   help=f"split long prefills across steps (default: {'on' if d.enable_chunked_prefill else 'off'})")
    g.add_argument("--kv-cache-memory-bytes", "--kv-cache-memory", type=parse_size, default=None,
                   help="memory for the KV pool, e.g. 512MiB or 2GB (default: what --max-num-seqs sequences of "
                        "--max-model-len tokens need, within the two limits below)")
    g.add_argument("--kv-cache-memory-fraction", type=float, default=None, metavar="FRACTION",
                   help="without --kv-cache-memory-bytes, the most of available memory the KV pool takes "
                        f"(default: {d.kv_cache_memory_fraction})")
    g.add_argument("--kv-cache-memory-max", type=parse_size, default=None,
                   help=f"without --kv-cache-memory-bytes, the most bytes the KV pool takes (default: {d.kv_cache_memory_max >> 30}GiB)")
    g.add_argument("--num-kv-blocks", type=_positive_int, default=None,
                   help="exact KV pool size in blocks (overrides --kv-cache-memory-bytes)")
    g.add_argument("--kv-cache-dtype", choices=("auto", "float32", "float16", "int8"), default=None,
                   help="KV cache element type; float16 halves what decode attention reads (many streams; "
                        "values rounded to float16); auto: float16 where tokenfab's C kernels read it (CPU, "
                        f"float32, head_dim a multiple of 64), else --dtype (default: {d.kv_cache_dtype})")
    g.add_argument("--kv-disk-dir", default=None, metavar="DIR",
                   help="the disk tier: save full prefix blocks in DIR (made if missing) and load them back on a "
                        "prefix hit, also after a restart (default: off; docs/architecture.md)")
    g.add_argument("--kv-disk-bytes", type=parse_size, default=None, metavar="SIZE",
                   help="with --kv-disk-dir, the most bytes its block files take, least recently used deleted "
                        f"first, e.g. 20GiB (default: {d.kv_disk_bytes >> 30}GiB)")
    # No argparse choices: EngineConfig.validate owns the list and names it when a value is wrong.
    g.add_argument("--quantization", "-q", default=None,
                   help="weights: auto (GGUF blocks as shipped, else float), none (float), gguf, int8, w8a8 "
                        "(int8 weights and activations), int4, int4-g32, int4-g64, int4-g128, q4_k or q6_k (GGUF K-quant "
                        "blocks) "
                        f"(default: {d.quantization})")
    g.add_argument("--scheduling-policy", choices=("fcfs", "priority"), default=None,
                   help=f"fcfs, or priority (lower `priority` values run first) (default: {d.scheduling_policy})")
    g.add_argument("--batch-prefill-share", type=float, default=None, metavar="FRACTION",
                   help="most of a step's token budget that batch-class prefills (service_tier flex, the Batch API) "
                        f"may take, so interactive prompts never wait behind a whole batch prefill (default: {d.batch_prefill_share})")
    g.add_argument("--long-prompt-threshold", type=_positive_int, default=None, metavar="TOKENS",
                   help="prompts of at least this many tokens prefill in their own lane, capped by "
                        "--max-long-prefill-tokens per step (default: no lane)")
    g.add_argument("--max-long-prefill-tokens", type=_positive_int, default=None, metavar="TOKENS",
                   help=f"the long-prompt lane's prefill tokens per step (default: {d.max_long_prefill_tokens})")
    g.add_argument("--enable-step-time-budget", action=argparse.BooleanOptionalAction, default=None,
                   help="admit batch rows and long-prompt prefill into a step only while the online step model "
                        "predicts it within the step-time limit (default: "
                        f"{'on' if d.enable_step_time_budget else 'off'}; docs/batch.md)")
    g.add_argument("--step-time-budget-ms", type=float, default=None, metavar="MS",
                   help="that limit (serve: --slo-tpot-ms when given); default: relative, see --step-time-slack")
    g.add_argument("--step-time-slack", type=float, default=None, metavar="FRACTION",
                   help="without a limit in ms, batch and long-prompt work may make interactive decode steps at most "
                        "this much slower on average, and a step with no interactive work at most this much longer than "
                        f"the mean interactive step while interactive requests arrive (default: {d.step_time_slack})")
    g.add_argument("--step-budget-min-tokens", type=int, default=None, metavar="TOKENS",
                   help="batch / long-prompt tokens a step takes over the limit when no interactive prompt waits "
                        "or prefills in it, so batch work never starves (default: "
                        f"{d.step_budget_min_tokens}; docs/batch.md)")
    g.add_argument("--seed", type=int, default=None, help=f"engine seed (default: {d.seed})")
    g.add_argument("--num-threads", type=_positive_int, default=None,
                   help="torch intra-op threads (default: torch's choice)")
    g.add_argument("--adaptive-threads", action=argparse.BooleanOptionalAction, default=None,
                   help="lower the thread count while other processes take the cores, restore it after "
                        f"(default: {'on' if d.adaptive_threads else 'off'})")
    g.add_argument("--small-batch-threads", type=int, default=None, metavar="N",
                   help=f"threads for steps of at most {d.small_batch_tokens} tokens (small decodes), like llama.cpp's "
                        "--threads beside --threads-batch; the thread controller is off then (default: 0, all)")
    g.add_argument("--attention-backend", default=None,
                   help=f"auto, torch (portable) or cpu (tokenfab's C kernels) (default: {d.attention_backend})")
    g.add_argument("--linear-kernel", default=None,
                   help="auto (the measured table) or one kernel forced where it runs: onednn, torch, qgemm, "
                        f"qmadd, qdot, qtile, qbf16, packed, float, bf16, dequant, w8a8 (default: {d.linear_kernel})")
    g.add_argument("--int8-activations", action=argparse.BooleanOptionalAction, default=None,
                   help="let the kernel table choose qdot: activations as int8 blocks of 32, integer dot products "
                        "(VNNI where the CPU has it), as llama.cpp; lossy (docs/quant.md) "
                        f"(default: {'on' if d.int8_activations else 'off'})")
    g.add_argument("--kernel-autotune", action=argparse.BooleanOptionalAction, default=None,
                   help="measure the kernel table on first load, cached per CPU under ~/.cache/tokenfab/tuning "
                        f"(default: {'on' if d.kernel_autotune else 'off'}; off: built-in rules)")
    g.add_argument("--enable-float-cache", action=argparse.BooleanOptionalAction, default=None,
                   help="float32 copies of quantized weights where the kernel table says they pay "
                        f"(default: {'on' if d.enable_float_cache else 'off'})")
    g.add_argument("--float-cache-memory", type=_size_or_zero, default=None,
                   help="bytes those float copies may take, e.g. 1GiB; 0: none (default: auto, only when decode "
                        "steps outgrow the C kernel's 16 rows: --max-num-seqs above 16)")
    g.add_argument("--float-cache-memory-fraction", type=float, default=None, metavar="FRACTION",
                   help=f"auto's share of available memory for them (default: {d.float_cache_memory_fraction})")
    g.add_argument("--prefill-attention-dtype", choices=("auto", "float32", "bfloat16"), default=None,
                   help="cpu backend, prefill attention: bfloat16 (AMX / AVX512-BF16, lossy) or float32; auto: "
                        "bfloat16 from the chunk size where the qkv projection runs the bf16 kernel, on CPUs "
                        f"with bf16 units (default: {d.prefill_attention_dtype})")
    g.add_argument("--paged-prefill-max-context", type=int, default=None, metavar="TOKENS",
                   help="cpu backend: prefill chunks with at most this many tokens of context attend through the "
                        f"paged decode kernel (float32) instead of SDPA; 0: never (default: {d.paged_prefill_max_context})")
    g.add_argument("--enable-fused-decode", action=argparse.BooleanOptionalAction, default=None,
                   help=f"cpu backend: one C call for the whole stack on small decode steps "
                        f"(default: {'on' if d.enable_fused_decode else 'off'})")
    g.add_argument("--tensor-parallel-size", "-tp", type=_positive_int, default=None, metavar="N",
                   help="split the model over N ranks (shared memory or gloo on CPU, NCCL on CUDA), launched "
                        "locally, or as Ray actors under --replicas "
                        f"(default: {d.tensor_parallel_size}; docs/tensor_parallel.md)")
    g.add_argument("--distributed-executor-backend", choices=("mp", "ray"), default=None,
                   help="how the tensor-parallel ranks start: mp (torch.multiprocessing) or ray (Ray actors) "
                        "(default: ray inside a Ray Serve replica, else mp)")
    g.add_argument("--tp-allreduce", choices=("auto", "shm", "gloo"), default=None,
                   help="how CPU ranks add their partial sums: shm (a buffer shared by local processes) or "
                        "gloo; auto: shm for local processes on x86-64, else gloo; CUDA uses NCCL "
                        f"(default: {d.tp_allreduce})")
    g.add_argument("--speculative-config", type=_json_dict, default=None, metavar="JSON",
                   help='speculative decoding, as vLLM: e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\' '
                        "(default: off; docs/speculative.md)")


class _Group:
    """An argument group that skips the excluded flags."""

    def __init__(self, group, excluded: set[str]) -> None:
        self.group, self.excluded = group, excluded

    def add_argument(self, *names, **kw):
        if not self.excluded.intersection(names):
            self.group.add_argument(*names, **kw)


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig the flags describe; flags left out keep the dataclass defaults.

    Raises ValueError (printed as one line by the CLI) when the combination is invalid.
    """
    given = {f.name: getattr(args, f.name) for f in fields(EngineConfig)
             if getattr(args, f.name, None) is not None}
    config = EngineConfig.from_kwargs(**given)
    config.validate()
    return config

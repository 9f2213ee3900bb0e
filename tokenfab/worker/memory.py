"""Where a worker's memory goes, and giving back what loading no longer needs.

- `available_memory`: free bytes on the device (the KV pool's and the float copies' shares are of it).
- `check_fits`: a model whose weights alone exceed the free memory is refused before loading, with the numbers.
- `memory_breakdown`: bytes by owner (weights, float copies, KV pool), for the log and `tokenfab info`.
- `float_copy_budget`: the bytes float32 copies of quantized weights may take (EngineConfig's
  `float_cache_memory`, or its automatic rule).
- `release_freed_memory`: loading reads every weight as float32 (the GGUF blocks are dequantized once,
  540 MB for the bundled model) and then keeps the blocks; the freed float tensors stay in glibc's heap
  as holes, and RSS keeps them. `malloc_trim` hands those pages back (223 MB on the bundled model).
- `process_rss`: resident bytes now, from /proc (for the start-up log and `tokenfab info --engine`).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

import torch

# Decode steps up to this many rows run tf_qgemm on the stored blocks (the built-in rules, and the one-call
# stack's rows): a float copy there would never be read by a decode step.
from tokenfab.kernels.tuning import QGEMM_DEFAULT_MAX_ROWS as QGEMM_DECODE_ROWS
from tokenfab.kernels.linear import plan_linears

log = logging.getLogger("tokenfab.worker")


def available_memory(device: str) -> int:
    """Free bytes on `device`: CUDA's free memory, or the host's MemAvailable (8 GiB where unknown)."""
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


def weights_bytes_needed(files, dtype: torch.dtype, quantization: str) -> int:
    """About the bytes the loaded weights will hold: a GGUF file run on its blocks holds about its size (the
    blocks as stored or re-packed at 6 bits per weight: at most 4/3 of it); anything else holds every
    parameter in `dtype` (float checkpoints, dequantized blocks, and float weights quantized after loading)."""
    if files.gguf_raw and quantization in ("auto", "gguf"):
        return os.path.getsize(files.path)
    return files.config.num_params() * torch.empty(0, dtype=dtype).element_size()


def check_fits(files, dtype: torch.dtype, quantization: str, device: str, tp: int = 1) -> None:
    """Refuse, before reading any weight, a model whose weights alone exceed the device's free memory: loading
    it would end in the kernel's OOM killer or in swap, not in a message. On GPUs each of `tp` ranks holds
    its share; CPU ranks share the host's memory."""
    from tokenfab.model.loader import ModelLoadError
    need, free = weights_bytes_needed(files, dtype, quantization), available_memory(device)
    if device.startswith("cuda"):
        need //= max(tp, 1)
    if need > free:
        raise ModelLoadError(
            f"{files.path}: its weights need about {need / 2**30:.1f} GiB ({files.config.num_params() / 1e9:.2f} B "
            f"parameters as {'the file stores them' if files.gguf_raw and quantization in ('auto', 'gguf') else dtype}), "
            f"and {device} has {free / 2**30:.1f} GiB free: use a smaller model or a smaller quantization "
            "(a Q4_K_M GGUF, --quantization int4), or free memory")


def decode_rows(config, num_speculative_tokens: int = 0) -> int:
    """The most rows a decode step feeds the decoder's linears: max_num_seqs x (1 + draft tokens)."""
    return config.max_num_seqs * (1 + num_speculative_tokens)


def float_copy_budget(config, available: int, kv_bytes: int, num_speculative_tokens: int = 0) -> tuple[int, str]:
    """Bytes float32 copies of quantized weights may take, and why.

    `float_cache_memory` given: that. Else (auto) none while every decode step fits tf_qgemm's rows
    (the copies would only speed up prefill chunks, ~2x there, at 4 bytes per weight: the bundled model's
    405 MiB against its 98 MB file); else `float_cache_memory_fraction` of available memory, less what
    the KV pool takes beyond its own `kv_cache_memory_fraction`."""
    if not config.enable_float_cache:
        return 0, "enable_float_cache off"
    if config.float_cache_memory is not None:
        return config.float_cache_memory, "float_cache_memory"
    rows = decode_rows(config, num_speculative_tokens)
    if rows <= QGEMM_DECODE_ROWS:
        return 0, (f"auto: decode steps of at most {rows} rows run tf_qgemm on the blocks; "
                   f"set float_cache_memory for faster prefill")
    share = config.float_cache_memory_fraction
    budget = max(0, min(int(available * share),
                        int(available * (share + config.kv_cache_memory_fraction)) - kv_bytes))
    return budget, f"auto: {share:.0%} of available memory for decode steps of up to {rows} rows"


def memory_breakdown(model: torch.nn.Module, float_copy_bytes: int, kv_bytes: int) -> dict[str, int]:
    """Bytes by owner: the weights as stored (quantized blocks, float tensors, kernels' packed
    layouts), the float copies of quantized weights the kernel table kept, and the KV pool."""
    seen: set[int] = set()
    weights = 0
    for t in list(model.parameters()) + list(model.buffers()):
        if t.data_ptr() not in seen and t.device.type != "meta":
            seen.add(t.data_ptr())
            weights += t.numel() * t.element_size()
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


def release_freed_memory() -> bool:
    """Return the heap's free pages to the OS (glibc's malloc_trim); False where there is no glibc."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        trim = libc.malloc_trim
    except (OSError, AttributeError, TypeError):
        return False
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    trim(0)
    return True


def process_rss(field: str = "VmRSS") -> int | None:
    """Resident bytes of this process (Linux /proc), else None; `field="VmHWM"`: its peak so far."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None

"""What rank 0's Worker built (worker/worker.py: the model, its tokenizer, the KV pool's sizing, the kernels
chosen, where the memory went), read through the engine core, which never builds any of it.
"""
from __future__ import annotations


def _from_worker(name: str, doc: str) -> property:
    """An attribute of rank 0's Worker, read through the engine (worker/worker.py builds it)."""
    return property(lambda self: getattr(self.executor.worker, name), doc=doc)


class WorkerAttributes:
    """Read-only attributes of `self.executor.worker`, for LLMEngine."""

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

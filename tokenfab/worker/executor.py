"""The executor: how the engine core reaches its workers. `UniProcExecutor` runs the one Worker in this
process (tensor_parallel_size 1); distributed/executor.TensorParallelExecutor runs the same Worker on
every rank and has the same surface:

- `worker`: rank 0's Worker (the model, tokenizer, KV sizing, kernel report and memory breakdown);
- `init_kv_cache(sliding)`: every rank allocates its KV pool;
- `runner`: what the core steps (`prepare(batch)`, then `execute(step) -> logits`);
- `close()`: release what outlives the object (worker processes). Idempotent.
"""
from __future__ import annotations

from tokenfab.model.loader import LoadedModel
from tokenfab.worker.model_runner import ModelRunner
from tokenfab.worker.worker import Worker


class UniProcExecutor:
    def __init__(self, config, loaded: LoadedModel | None = None, speculative=None):
        self.worker = Worker(config, loaded=loaded, speculative=speculative)
        self.runner: ModelRunner | None = None

    def init_kv_cache(self, sliding=None) -> None:
        self.runner = self.worker.init_kv_cache(sliding)

    def close(self) -> None:
        pass

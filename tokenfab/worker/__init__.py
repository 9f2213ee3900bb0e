"""The worker side: what runs the model on each rank, below the engine core (engine/).

- `worker.py`       Worker: loads the model, sizes the KV pool, chooses kernels, allocates the KV cache;
- `model_runner.py` ModelRunner: the KV pool, and one step's flat batch through the model;
- `executor.py`     UniProcExecutor: the one Worker in this process (distributed/ has the tensor-parallel one);
- `memory.py`       available memory, the float-copy budget, the memory breakdown;
- `kv_sizing.py`    how many KV blocks (and sliding-window blocks) the budget holds;
- `draft_model.py`  the speculative draft model, loaded and built beside the target.

Nothing here imports the engine core: the core hands down a scheduled batch and reads back logits.
"""

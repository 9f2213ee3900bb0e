"""The KV connector seam: KV blocks held outside this engine's pool (another engine, a slower tier).

A connector has two sides, keyed by the prefix cache's content hashes (BlockManager.chain_hash, whose
chain starts from `key_seed(model, KV dtype, block size)`, so a block's key names its tokens and
everything before them, the model that computed it, how its K/V are stored and how many tokens it holds):
- the scheduler side, `match(block_hashes)`: asked when a waiting prompt is admitted, with the hashes
  of its full prefix blocks after those the local prefix cache holds. It answers how many of them,
  from the first, it can supply, and whether they are ready now. A prompt whose blocks are not ready
  waits (WAITING_FOR_REMOTE_KV) without holding up the prompts behind it, and is asked again next step.
- the worker side moves blocks between the connector and the KV pool: `start_load` fills the pool
  blocks that the scheduler took for matched blocks (the step waits for them, `wait_for_load`, before the
  model runs), and `start_save` hands over the blocks that became full in a step, which it must have read
  by `wait_for_save` (called before the next step writes the pool). Both may run in the background.
The pool is the list of the runner's KV tensors (values, and int8 scales), each with blocks on dim 2.

`KVConnectorBinding` wires a connector into an engine: off by default (the engine holds None and the
block manager collects no full blocks), so a step without a connector pays nothing.
`DiskKVConnector` (engine/kv_disk.py) is the disk tier. `InMemoryKVConnector` is the trivial connector: a dict from content hash to the block's tensors, which
several engines in one process may share.
"""
from __future__ import annotations

import hashlib
from typing import Protocol

import torch


class KVConnectorScheduler(Protocol):
    def match(self, block_hashes: list[int]) -> tuple[int, bool]:
        """How many of `block_hashes`, from the first, this connector can supply, and whether now."""


class KVConnectorWorker(Protocol):
    def bind(self, key_seed: int, block_size: int, pool: list[torch.Tensor]) -> None:
        """Called once, before anything else: the engine's key seed, block size and KV pool."""

    def close(self) -> None:
        """The engine is closing: finish what was handed over (saves) and stop any threads."""

    def start_load(self, blocks: list[tuple[int, int]], pool: list[torch.Tensor]) -> None:
        """Fill pool block ids with the K/V saved under their hashes: (hash, block id) pairs."""

    def wait_for_load(self) -> None:
        """Return when every started load is in the pool."""

    def start_save(self, blocks: list[tuple[int, int]], pool: list[torch.Tensor]) -> None:
        """Keep the K/V of full pool blocks under their hashes: (hash, block id) pairs."""

    def wait_for_save(self) -> None:
        """Return when every started save has read its blocks (the pool may be written after)."""


class KVConnector(KVConnectorScheduler, KVConnectorWorker, Protocol):
    """Both sides in one object (one process); a disaggregated deployment may split them."""


def key_seed(model: str, kv_dtype: torch.dtype, block_size: int) -> int:
    """The first parent of the prefix cache's hash chain: a digest, stable across processes (Python's
    hash of a str is not), of what makes two blocks of the same tokens interchangeable."""
    digest = hashlib.sha256(f"{model}|{kv_dtype}|{block_size}".encode()).digest()
    return int.from_bytes(digest[:8], "little", signed=True)


class KVConnectorBinding:
    """A connector wired to one engine's scheduler, block manager and KV pool."""

    def __init__(self, connector: KVConnector, scheduler, runner, config, model: str):
        """`config`: the EngineConfig; `model`: the model's name or path, part of every key."""
        bm = scheduler.bm
        if not bm.enable_prefix_caching:
            raise ValueError("a kv_connector needs enable_prefix_caching: its keys are the prefix cache's hashes")
        if bm.sliding is not None or config.tensor_parallel_size != 1:
            raise ValueError("a kv_connector supports one KV pool in one process (no sliding-window pool, "
                             "tensor_parallel_size 1)")
        self.connector, self.bm = connector, bm
        self.pool = [t for t in (runner.kv, runner.kv_scales) if t is not None]
        bm.hash_seed = key_seed(model, runner.kv.dtype, config.block_size)
        connector.bind(bm.hash_seed, config.block_size, self.pool)
        bm.newly_full = []
        scheduler.kv_connector = connector

    def close(self) -> None:
        self.connector.close()

    def load(self, blocks: list[tuple[int, int]]) -> None:
        """Before the model runs: the step's matched blocks are in the pool, and earlier saves have read theirs."""
        self.connector.wait_for_save()
        if blocks:
            self.connector.start_load(blocks, self.pool)
            self.connector.wait_for_load()

    def save_new_blocks(self) -> None:
        """After the step's update: hand over the blocks that became full in it."""
        blocks = self.bm.newly_full
        if blocks:
            self.bm.newly_full = []
            self.connector.start_save(blocks, self.pool)


class InMemoryKVConnector:
    """Blocks kept in a dict in this process, copied in and out synchronously; always ready."""

    def __init__(self, store: dict[int, list[torch.Tensor]] | None = None):
        self.store = {} if store is None else store

    def bind(self, key_seed: int, block_size: int, pool: list[torch.Tensor]) -> None:
        pass

    def close(self) -> None:
        pass

    def match(self, block_hashes: list[int]) -> tuple[int, bool]:
        n = 0
        while n < len(block_hashes) and block_hashes[n] in self.store:
            n += 1
        return n, True

    def start_load(self, blocks: list[tuple[int, int]], pool: list[torch.Tensor]) -> None:
        for h, b in blocks:
            for t, saved in zip(pool, self.store[h]):
                t[:, :, b].copy_(saved)

    def wait_for_load(self) -> None:
        pass

    def start_save(self, blocks: list[tuple[int, int]], pool: list[torch.Tensor]) -> None:
        for h, b in blocks:
            if h not in self.store:
                self.store[h] = [t[:, :, b].clone() for t in pool]

    def wait_for_save(self) -> None:
        pass

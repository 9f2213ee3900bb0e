"""DiskKVConnector: the disk tier, a prefix cache in a directory that outlives the process.

Behind the KV connector seam (engine/kv_connector.py), with one file per full prefix block
(engine/kv_block_file.py), named by the block's content hash:
- Saving: every block that becomes full is handed over (`start_save`); a block already on disk or on
  its way is skipped. `start_save` copies the block's tensors (a memcpy of a few hundred kB) and a
  writer thread writes them to a temporary name and renames it, so a step never waits for the disk and a
  crash never leaves half a file under a block's name. Saves queued beyond `max_pending_saves` are
  dropped (counted), so a slow disk costs hits, never memory or step time.
- Budget: the files indexed here stay within `max_bytes`: before a write, the least recently used files
  are deleted until the new one fits. Use is a save or a load; a load also sets the file's mtime, so a
  restart orders the index by it.
- Finding blocks: at `bind` (once the engine knows the key seed and the pool's layout) the directory's
  block files are scanned, headers only, into the index; `match` answers from it. A block not yet read
  is read and checked (header and checksum) by a reader thread, and `match` says "not ready" meanwhile
  (the prompt waits in WAITING_FOR_REMOTE_KV without holding up others); once read, the blocks are held
  in memory until the step that admitted them copies them into the pool (`start_load`).
- Skipping: a file that is corrupt, truncated, from another model or layout, or from another format or
  tokenfab version is never loaded. It is logged once, counted, and left out of the index; ours but
  broken (corrupt, truncated) it is deleted, since a save rewrites it. The prompt then computes the block.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, fields
from pathlib import Path

import torch

from tokenfab.engine.kv_block_file import (BlockFileError, BlockLayout, encode_parts, file_name, hash_of, read_block,
                                          read_header)

log = logging.getLogger("tokenfab.kv_disk")

STAGED_TTL_S = 60.0     # read blocks no prompt took (its request aborted) are dropped after this long


def _lower_priority() -> None:
    """Run the calling thread at a lower CPU priority (Linux: a thread's nice value is its own), so that on
    a machine whose cores the steps keep busy, writing files waits for the steps rather than the reverse."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
    except (AttributeError, OSError):
        pass


@dataclass(slots=True)
class DiskTierStats:
    """Counters since start, and the directory's bytes now (EngineStats.kv_disk_*, /metrics)."""
    hit_blocks: int = 0          # blocks loaded into the pool from disk
    hit_tokens: int = 0
    miss_blocks: int = 0         # full prefix blocks asked for that no file held (each admission answer)
    bytes_written: int = 0
    bytes_read: int = 0
    skipped_files: int = 0       # files not loaded: corrupt, truncated, foreign, other version
    dropped_saves: int = 0       # blocks not saved because the writer was behind
    load_seconds: float = 0.0    # reading and checking block files, summed ...
    loads: int = 0               # ... over this many files
    bytes_used: int = 0          # the indexed files' bytes (within the budget)

    def fill(self, stats) -> None:
        """Copy these into an EngineStats's kv_disk_* fields (engine/client.py)."""
        for f in fields(self):
            setattr(stats, "kv_disk_" + f.name, getattr(self, f.name))


def connector_for(config, kv_connector):
    """The engine's KV connector: the disk tier when `config.kv_disk_dir` is set (ValueError beside another
    connector), else `kv_connector` as given."""
    if config.kv_disk_dir is None:
        return kv_connector
    if kv_connector is not None:
        raise ValueError("give kv_disk_dir or a kv_connector, not both")
    return DiskKVConnector(config.kv_disk_dir, config.kv_disk_bytes)


class DiskKVConnector:
    """Both sides of the connector seam over one directory; `bind` must be called before use (the engine's
    KVConnectorBinding does)."""

    def __init__(self, directory: str | os.PathLike, max_bytes: int, max_pending_saves: int = 256):
        self.dir = Path(directory).expanduser()
        if not self.dir.parent.is_dir():
            raise ValueError(f"kv_disk_dir {str(self.dir)!r}: its parent {str(self.dir.parent)!r} does not exist")
        if self.dir.exists() and not self.dir.is_dir():
            raise ValueError(f"kv_disk_dir {str(self.dir)!r} is a file, not a directory")
        if not isinstance(max_bytes, int) or isinstance(max_bytes, bool) or max_bytes < 1:
            raise ValueError(f"kv_disk_bytes must be a positive number of bytes, got {max_bytes!r}")
        self.dir.mkdir(exist_ok=True)
        if not os.access(self.dir, os.W_OK | os.X_OK):
            raise ValueError(f"kv_disk_dir {str(self.dir)!r} is not writable")
        self.max_bytes, self.max_pending_saves = max_bytes, max_pending_saves
        self.stats = DiskTierStats()
        self.layout: BlockLayout | None = None
        self._lock = threading.Lock()
        self._index: OrderedDict[int, int] = OrderedDict()    # hash -> file bytes, least recently used first
        self._staged: dict[int, tuple[list[torch.Tensor], float]] = {}   # read and checked, not yet loaded
        self._reading: set[int] = set()
        self._saving: set[int] = set()
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="tokenfab-kv-disk-read")
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="tokenfab-kv-disk-write", initializer=_lower_priority)

    # -- set-up ---------------------------------------------------------------------------------
    def bind(self, key_seed: int, block_size: int, pool: list[torch.Tensor]) -> None:
        """Learn the blocks' layout and index the directory's files of it (headers only)."""
        self.layout = BlockLayout.of_pool(key_seed, block_size, pool)
        one = self.layout.file_bytes(-(1 << 63))   # the widest header
        if self.max_bytes < one:
            raise ValueError(f"kv_disk_bytes {self.max_bytes} holds no block: one block file of this model is "
                             f"{one} bytes; give at least that, e.g. {max(one * 1024, 1 << 30)}")
        found = []
        for path in self.dir.iterdir():
            if path.name.endswith(".tmp"):          # a write cut short by a crash
                path.unlink(missing_ok=True)
                continue
            h = hash_of(path)
            if h is None:
                continue
            try:
                read_header(path, self.layout, h)
                st = path.stat()
            except BlockFileError as e:
                self._skip(path, e)
                continue
            except OSError:
                continue
            found.append((st.st_mtime, h, st.st_size))
        for _, h, size in sorted(found):
            self._index[h] = size
            self.stats.bytes_used += size
        self._evict(0)
        log.info("kv disk tier %s: %d blocks, %d bytes of %d", self.dir, len(self._index),
                 self.stats.bytes_used, self.max_bytes)

    def close(self) -> None:
        """Finish the queued writes and stop the threads."""
        self._writer.shutdown(wait=True)
        self._reader.shutdown(wait=True)

    def drain(self) -> None:
        """Return when every save handed over and every read started so far is done (tests, tools)."""
        self._writer.submit(lambda: None).result()
        self._reader.submit(lambda: None).result()

    # -- scheduler side -------------------------------------------------------------------------
    def match(self, block_hashes: list[int]) -> tuple[int, bool]:
        with self._lock:
            n = 0
            while n < len(block_hashes) and block_hashes[n] in self._index:
                self._index.move_to_end(block_hashes[n])
                n += 1
            self._drop_stale_staged()
            todo = [h for h in block_hashes[:n] if h not in self._staged and h not in self._reading]
            ready = all(h in self._staged for h in block_hashes[:n])
            if ready:
                self.stats.miss_blocks += len(block_hashes) - n
            self._reading.update(todo)
        if todo:
            self._reader.submit(self._read, todo)
        return n, ready

    def _drop_stale_staged(self) -> None:
        old = time.monotonic() - STAGED_TTL_S
        for h in [h for h, (_, t) in self._staged.items() if t < old]:
            del self._staged[h]

    # -- worker side ----------------------------------------------------------------------------
    def start_load(self, blocks: list[tuple[int, int]], pool: list[torch.Tensor]) -> None:
        for h, b in blocks:
            with self._lock:
                staged = self._staged.pop(h, None)
            # match answered ready only with every block staged, and only match's own step loads it
            tensors = staged[0] if staged is not None else read_block(self.dir / file_name(h), self.layout, h)
            for t, saved in zip(pool, tensors):
                t[:, :, b].copy_(saved)
            self.stats.hit_blocks += 1
            self.stats.hit_tokens += self.layout.block_size

    def wait_for_load(self) -> None:
        pass                              # start_load copies synchronously: the reads happened before match said ready

    def start_save(self, blocks: list[tuple[int, int]], pool: list[torch.Tensor]) -> None:
        for h, b in blocks:
            with self._lock:
                if h in self._index or h in self._saving:
                    continue
                if len(self._saving) >= self.max_pending_saves:
                    self.stats.dropped_saves += 1
                    continue
                self._saving.add(h)
            self._writer.submit(self._write, h, [t[:, :, b].clone() for t in pool])

    def wait_for_save(self) -> None:
        pass                              # start_save has copied its blocks before returning

    # -- the threads ----------------------------------------------------------------------------
    def _read(self, hashes: list[int]) -> None:
        for h in hashes:
            path = self.dir / file_name(h)
            t0 = time.perf_counter()
            try:
                tensors = read_block(path, self.layout, h)
                os.utime(path)            # last use, for the LRU order after a restart
            except (BlockFileError, OSError) as e:
                with self._lock:
                    size = self._index.pop(h, None)
                    if size is not None:
                        self.stats.bytes_used -= size
                    self._reading.discard(h)
                if isinstance(e, BlockFileError):
                    self._skip(path, e)
                continue
            dt = time.perf_counter() - t0
            with self._lock:
                self._staged[h] = (tensors, time.monotonic())
                self._reading.discard(h)
                self.stats.bytes_read += self._index.get(h, 0)
                self.stats.load_seconds += dt
                self.stats.loads += 1

    def _write(self, h: int, tensors: list[torch.Tensor]) -> None:
        try:
            parts = encode_parts(self.layout, h, tensors)
            size = sum(len(p) if isinstance(p, bytes) else p.nbytes for p in parts)
            path = self.dir / file_name(h)
            with self._lock:
                self._evict(size)        # the directory stays within budget with the new file in it
            tmp = path.with_name(path.name + ".tmp")
            with open(tmp, "wb") as f:
                f.writelines(parts)
            os.replace(tmp, path)
            with self._lock:
                self._index[h] = size
                self.stats.bytes_used += size
                self.stats.bytes_written += size
        except OSError as e:
            log.warning("kv disk tier: could not write block %s: %s", file_name(h), e)
        finally:
            with self._lock:
                self._saving.discard(h)

    def _evict(self, room: int) -> None:
        """Delete least recently used files until `room` more bytes fit. Holds the lock."""
        while self._index and self.stats.bytes_used + room > self.max_bytes:
            h, size = self._index.popitem(last=False)
            self.stats.bytes_used -= size
            (self.dir / file_name(h)).unlink(missing_ok=True)

    def _skip(self, path: Path, e: BlockFileError) -> None:
        log.warning("kv disk tier: skipping %s (%s)", path, e)
        self.stats.skipped_files += 1
        if e.kind in ("corrupt", "truncated"):
            path.unlink(missing_ok=True)

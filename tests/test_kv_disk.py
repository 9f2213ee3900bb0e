"""The disk tier (engine/kv_disk.py, engine/kv_block_file.py): block files round-trip bit-equal, damaged or
foreign files are skipped, the byte budget holds, and through the engine a restart on the same directory
serves a shared prefix from disk with the output of a cold run."""
from __future__ import annotations

import argparse
import json
import shutil
import struct
from pathlib import Path

import pytest
import torch

from tokenfab import LLM, SamplingParams
from tokenfab.config import EngineConfig
from tokenfab.engine.client import EngineStats
from tokenfab.engine.kv_block_file import MAGIC, BlockLayout, encode, file_name
from tokenfab.engine.kv_disk import DiskKVConnector
from tokenfab.engine_args import add_engine_args, engine_config_from_args

BLOCK = 4
SEED = 12345


def pool_of(dtype: torch.dtype, num_blocks: int = 8, fill: bool = True) -> list[torch.Tensor]:
    """A pool shaped as the runner's: (layers, K/V, blocks, block size, heads, head dim), int8 with scales."""
    shape = (2, 2, num_blocks, BLOCK, 2, 8)
    g = torch.Generator().manual_seed(0)
    if dtype == torch.int8:
        kv = torch.randint(-128, 128, shape, generator=g, dtype=torch.int8)
        pool = [kv, torch.rand(shape[:-1], generator=g)]
    else:
        pool = [torch.randn(shape, generator=g).to(dtype)]
    return pool if fill else [torch.zeros_like(t) for t in pool]


def connector(directory: Path, pool: list[torch.Tensor], max_bytes: int = 1 << 30, seed: int = SEED) -> DiskKVConnector:
    c = DiskKVConnector(directory, max_bytes)
    c.bind(seed, BLOCK, pool)
    return c


def ask(c: DiskKVConnector, hashes: list[int]) -> int:
    """What `match` answers once the reads it starts are done (the scheduler asks again each step)."""
    n, ready = c.match(hashes)
    if not ready:
        c.drain()
        n, ready = c.match(hashes)
    assert ready
    return n


def file_size(layout_pool: list[torch.Tensor]) -> int:
    return BlockLayout.of_pool(SEED, BLOCK, layout_pool).file_bytes(-(1 << 63))


def dir_bytes(d: Path) -> int:
    return sum(p.stat().st_size for p in d.iterdir())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int8])
def test_a_saved_block_loads_back_bit_equal_after_a_restart(tmp_path, dtype):
    src = pool_of(dtype)
    first = connector(tmp_path, src)
    first.start_save([(11, 3), (-22, 5)], src)
    first.close()
    dst = pool_of(dtype, fill=False)
    second = connector(tmp_path, dst)                      # a new process would see the same directory
    assert ask(second, [11, -22, 33]) == 2
    second.start_load([(11, 0), (-22, 6)], dst)
    for s, d in zip(src, dst):
        assert torch.equal(d[:, :, 0], s[:, :, 3]) and torch.equal(d[:, :, 6], s[:, :, 5])
    assert second.stats.hit_blocks == 2 and second.stats.miss_blocks == 1 and second.stats.bytes_read > 0


def damage(path: Path, kind: str, pool: list[torch.Tensor]) -> None:
    data = bytearray(path.read_bytes())
    if kind == "flipped":
        data[-10] ^= 0xFF                                  # a payload byte: only the checksum sees it
        path.write_bytes(bytes(data))
    elif kind == "truncated":
        path.write_bytes(bytes(data[:len(data) // 2]))
    elif kind == "foreign":                                # another model's block under the same name
        other = BlockLayout.of_pool(SEED + 1, BLOCK, pool)
        h = json.loads(data[len(MAGIC) + 4:len(MAGIC) + 4 + struct.unpack_from("<I", data, len(MAGIC))[0]])["hash"]
        path.write_bytes(encode(other, h, [t[:, :, 0] for t in pool]))
    elif kind == "version":
        n = struct.unpack_from("<I", data, len(MAGIC))[0]
        header = json.loads(data[len(MAGIC) + 4:len(MAGIC) + 4 + n])
        header["tokenfab"] = "0.0.0-other"
        raw = json.dumps(header).encode()
        path.write_bytes(MAGIC + struct.pack("<I", len(raw)) + raw + bytes(data[len(MAGIC) + 4 + n:]))
    else:
        raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["flipped", "truncated", "foreign", "version"])
def test_a_damaged_or_foreign_block_file_is_skipped_and_the_chain_stops_before_it(tmp_path, kind, caplog):
    src = pool_of(torch.float32)
    first = connector(tmp_path, src)
    first.start_save([(1, 1), (2, 2), (3, 3)], src)
    first.close()
    damage(tmp_path / file_name(2), kind, src)
    dst = pool_of(torch.float32, fill=False)
    second = connector(tmp_path, dst)
    assert ask(second, [1, 2, 3]) == 1                     # block 2 is never offered, so neither is 3
    assert second.stats.skipped_files == 1
    assert any(file_name(2) in r.getMessage() and "skipping" in r.getMessage() for r in caplog.records)
    second.start_load([(1, 0)], dst)
    assert torch.equal(dst[0][:, :, 0], src[0][:, :, 1])
    assert not dst[0][:, :, 1:].any()                      # nothing else was written into the pool


def test_the_byte_budget_holds_under_churn_and_evicts_the_least_recently_used(tmp_path):
    pool = pool_of(torch.float32)
    budget = 5 * file_size(pool)
    c = connector(tmp_path, pool, max_bytes=budget)
    for h in range(5):
        c.start_save([(h, h)], pool)
    c.drain()
    assert ask(c, [0]) == 1                                # 0 used: now the most recent
    for h in range(100, 160):                              # churn: twelve budgets' worth
        c.start_save([(h, h % 8)], pool)
        if h % 7 == 0:
            c.drain()
            assert dir_bytes(tmp_path) <= budget
    c.drain()
    assert dir_bytes(tmp_path) <= budget and c.stats.bytes_used <= budget
    assert len(list(tmp_path.iterdir())) == 5
    assert ask(c, [159]) == 1 and ask(c, [100]) == 0
    c.close()


def test_use_orders_eviction(tmp_path):
    pool = pool_of(torch.float32)
    c = connector(tmp_path, pool, max_bytes=3 * file_size(pool))
    c.start_save([(1, 1), (2, 2), (3, 3)], pool)
    c.drain()
    assert ask(c, [1]) == 1                                # 1 used after 2 and 3 were written
    c.start_save([(4, 4)], pool)
    c.drain()
    assert [ask(c, [h]) for h in (1, 2, 3, 4)] == [1, 0, 1, 1]
    c.close()


def test_a_budget_below_one_block_is_refused(tmp_path):
    pool = pool_of(torch.float32)
    with pytest.raises(ValueError, match="holds no block"):
        connector(tmp_path, pool, max_bytes=file_size(pool) - 1)


def test_a_missing_directory_is_made_and_a_missing_parent_is_refused(tmp_path):
    DiskKVConnector(tmp_path / "new", 1 << 20).close()
    assert (tmp_path / "new").is_dir()
    with pytest.raises(ValueError, match="does not exist"):
        EngineConfig(kv_disk_dir=str(tmp_path / "no" / "such")).validate()
    with pytest.raises(ValueError, match="positive number of bytes"):
        EngineConfig(kv_disk_dir=str(tmp_path), kv_disk_bytes=0).validate()
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        EngineConfig(kv_disk_dir=str(tmp_path), enable_prefix_caching=False).validate()


def test_the_flags_set_the_config(tmp_path):
    p = argparse.ArgumentParser()
    add_engine_args(p)
    config = engine_config_from_args(p.parse_args(["--kv-disk-dir", str(tmp_path), "--kv-disk-bytes", "2GiB"]))
    assert config.kv_disk_dir == str(tmp_path) and config.kv_disk_bytes == 2 << 30


def test_the_tier_is_on_metrics():
    from types import SimpleNamespace
    from tokenfab.server.metrics import ServerMetrics
    stats = EngineStats(0, 0, 0.0, 8, 0, 0, 0, 0, 0, kv_disk_hit_blocks=3, kv_disk_hit_tokens=48,
                        kv_disk_loads=3, kv_disk_load_seconds=0.25, kv_disk_skipped_files=1)
    client = SimpleNamespace(stats=lambda: stats, info=SimpleNamespace(config_labels={}), dead_reason=None)
    text = ServerMetrics(client, "m").render().decode()
    assert 'tokenfab:kv_disk_hit_tokens_total{model_name="m"} 48.0' in text
    assert 'tokenfab:kv_disk_skipped_files_total{model_name="m"} 1.0' in text
    assert 'tokenfab:kv_disk_load_seconds_count{model_name="m"} 3.0' in text
    assert 'tokenfab:kv_disk_load_seconds_sum{model_name="m"} 0.25' in text


# -- through the engine, on the bundled model (kept short: each engine and each generated token count) ---

SYSTEM = ("You are a careful assistant for a library of technical manuals. Answer in one short sentence, "
          "and say so plainly when the manuals do not cover it. ") * 2
A, B = SYSTEM + "Where is the index?", SYSTEM + "How do I reset the device?"
GREEDY = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
KW = dict(quantization="none", kv_cache_dtype="float32", max_model_len=512, block_size=16)


def llm(files, **kw) -> LLM:
    return LLM(loaded=files, **{**KW, "num_kv_blocks": 64, **kw})


def tokens(engine: LLM, prompt) -> list[int] | list[list[int]]:
    outs = engine.generate(prompt, GREEDY, use_tqdm=False)
    return outs[0].outputs[0].token_ids if isinstance(prompt, str) else [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def cold(bundled_files) -> dict[str, list[int]]:
    """A and B computed without any cache: the reference."""
    ref = llm(bundled_files, enable_prefix_caching=False)
    return {A: tokens(ref, A), B: tokens(ref, B)}


@pytest.fixture(scope="module")
def saved(bundled_files, tmp_path_factory) -> Path:
    """A directory where a closed engine saved the blocks of A."""
    d = tmp_path_factory.mktemp("kv_disk")
    first = llm(bundled_files, kv_disk_dir=str(d))
    tokens(first, A)
    first.close()                                          # its queued writes finish
    assert first.engine.stats().kv_disk_bytes_written > 0
    return d


def restarted(saved: Path, tmp_path: Path) -> Path:
    shutil.copytree(saved, tmp_path / "d")
    return tmp_path / "d"


def test_a_restart_serves_the_shared_prefix_from_disk_with_the_cold_output(bundled_files, saved, tmp_path, cold):
    second = llm(bundled_files, kv_disk_dir=str(restarted(saved, tmp_path)))
    out = second.generate(B, GREEDY, use_tqdm=False)[0]    # a new question after the same system prompt
    stats = second.engine.stats()
    shared = len(second.tokenizer.encode(SYSTEM)) // 16    # full blocks of the system prompt alone
    assert stats.kv_disk_hit_blocks >= shared - 1 and out.num_cached_tokens == stats.kv_disk_hit_tokens > 0
    assert stats.prefix_cache_hits == 0                    # nothing came from the new process's own pool
    assert out.outputs[0].token_ids == cold[B]
    assert second.engine.block_manager.num_used_blocks() == 0
    second.close()


def test_a_restart_skips_damaged_and_foreign_files_and_still_answers_right(bundled_files, saved, tmp_path, cold):
    d = restarted(saved, tmp_path)
    files = sorted(d.iterdir())
    assert len(files) >= 3
    pool = [torch.zeros(30, 2, 1, 16, 3, 64)]             # the layout does not matter: another seed is foreign
    for path, kind in zip(files, ("flipped", "truncated", "foreign")):
        damage(path, kind, pool)
    second = llm(bundled_files, kv_disk_dir=str(d))
    assert tokens(second, A) == cold[A]
    # file names are content hashes, so which chain positions were damaged varies with the model's path; the
    # chain stops at the first bad block, so the ones after it are never read (each kind alone: the unit tests)
    assert 1 <= second.engine.stats().kv_disk_skipped_files <= 3
    second.close()


def test_a_full_pool_takes_disk_blocks_as_room_allows(bundled_files, saved, tmp_path, cold):
    small = llm(bundled_files, kv_disk_dir=str(restarted(saved, tmp_path)), num_kv_blocks=10)
    other = "Unrelated text about gardens and the weather, long enough to fill a few blocks. " * 3
    outs = tokens(small, [A, other, B])                    # 5 shared blocks + 2 + 4: more than the pool
    assert small.engine.stats().kv_disk_hit_blocks > 0
    assert outs[0] == cold[A] and outs[2] == cold[B]
    assert small.engine.block_manager.num_used_blocks() == 0
    small.close()

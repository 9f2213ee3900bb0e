"""The KV connector seam (engine/kv_connector.py): the scheduler side on a bare BlockManager, and two
engines sharing an in-memory connector."""
from __future__ import annotations

import torch

from tokenfab import LLM, SamplingParams
from tokenfab.engine.kv_cache import BlockManager
from tokenfab.engine.kv_connector import InMemoryKVConnector, key_seed
from tokenfab.engine.scheduler import Scheduler
from tokenfab.engine.sequence import Sequence, SequenceStatus
from tokenfab.engine.update import ModelOutput

BLOCK = 4


class SlowConnector(InMemoryKVConnector):
    """Holds every block asked for, ready only from the `ready_after`-th question on."""

    def __init__(self, ready_after: int):
        super().__init__()
        self.asked, self.ready_after = 0, ready_after

    def match(self, block_hashes):
        self.asked += 1
        return len(block_hashes), self.asked > self.ready_after


def seq(rid: str, n: int) -> Sequence:
    base = 1000 * (sum(map(ord, rid)) % 97)
    return Sequence(rid, 0, [base + k for k in range(n)], SamplingParams(), max_tokens=4)


def test_a_prompt_waits_for_remote_blocks_without_holding_up_the_ones_behind_it():
    s = Scheduler(BlockManager(32, BLOCK), 8, 64)
    s.kv_connector = SlowConnector(ready_after=1)
    remote, local = seq("remote", 10), seq("local", 6)
    s.add(remote)
    s.add(local)
    batch = s.schedule()
    assert batch.seqs == [local] and remote.status is SequenceStatus.WAITING_FOR_REMOTE_KV
    s.update_from_output(batch, ModelOutput.stand_in(batch, 7))
    batch = s.schedule()                                # ready now: 2 of its blocks load, 2 tokens run
    i = batch.seqs.index(remote)
    assert batch.num_new_tokens[i] == 2 and remote.num_computed_tokens == 8 and remote.num_cached_tokens == 8
    assert [b for _, b in batch.kv_loads] == remote.block_table[:2]
    assert [h for h, _ in batch.kv_loads] == s.bm.prefix_hashes(remote.token_ids, [])


def test_the_keys_name_the_model_the_kv_dtype_and_the_block_size():
    base = key_seed("m", torch.float32, 16)
    assert base == key_seed("m", torch.float32, 16)
    assert len({base, key_seed("n", torch.float32, 16), key_seed("m", torch.bfloat16, 16),
                key_seed("m", torch.float32, 32)}) == 4


def test_a_second_engine_loads_the_saved_prefix_and_matches_computing_it(bundled_files):
    store: dict = {}
    kw = dict(loaded=bundled_files, quantization="none", kv_cache_dtype="float32", max_model_len=512,
              num_kv_blocks=64, block_size=16)
    prompt = ("the quick brown fox jumps over a lazy dog while seven clever engineers write fast kernels " * 5).strip()
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    first = LLM(kv_connector=InMemoryKVConnector(store), **kw)
    computed = first.generate(prompt, greedy, use_tqdm=False)[0]
    n_prompt = len(computed.prompt_token_ids)
    assert len(store) >= (n_prompt - 1) // 16                    # its full blocks were saved

    second = LLM(kv_connector=InMemoryKVConnector(store), **kw)   # a fresh pool: nothing cached locally
    loaded = second.generate(prompt, greedy, use_tqdm=False)[0]
    assert loaded.num_cached_tokens == (n_prompt - 1) // 16 * 16   # every full prefix block was loaded
    assert second.engine.stats().prefix_cache_hits == 0
    assert loaded.outputs[0].token_ids == computed.outputs[0].token_ids
    assert second.engine.block_manager.num_used_blocks() == 0

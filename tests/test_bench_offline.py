"""`bench offline`: the prefill/decode arithmetic on a scripted engine and clock, and a real run
on the bundled model once the engine is there."""
import json
import random
from dataclasses import dataclass

import pytest

from tokenfab.bench.offline import OfflineConfig, measure_batch, run_offline

PREFILL_S_PER_TOKEN, DECODE_S_PER_STEP = 0.001, 0.02


@dataclass
class Params:
    max_tokens: int
    temperature: float
    ignore_eos: bool


@dataclass
class Completion:
    token_ids: list


@dataclass
class Output:
    prompt_token_ids: list
    outputs: list


class ScriptedLLM:
    """Advances a fake clock as a batched engine would: prefill per token, decode per step."""

    def __init__(self, clock):
        self.clock = clock
        self.calls = []

    def generate(self, prompts, params, use_tqdm=True):
        self.calls.append((len(prompts), params.max_tokens))
        self.clock.now += PREFILL_S_PER_TOKEN * sum(len(p) for p in prompts)
        self.clock.now += DECODE_S_PER_STEP * (params.max_tokens - 1)
        return [Output(list(p), [Completion([7] * params.max_tokens)]) for p in prompts]


class Clock:
    now = 0.0

    def __call__(self):
        return self.now


def test_prefill_and_decode_rates_follow_from_the_two_timed_runs():
    clock = Clock()
    run = measure_batch(ScriptedLLM(clock), Params, list(range(100, 200)), batch=4, input_len=50, output_len=11,
                        rng=random.Random(0), clock=clock)
    assert run.prompt_tokens == 200 and run.output_tokens == 44
    assert run.prefill_s == pytest.approx(200 * PREFILL_S_PER_TOKEN)
    assert run.prefill_tok_s == pytest.approx(1 / PREFILL_S_PER_TOKEN)
    # 10 decode steps of 4 sequences beyond the first token: 40 tokens in 10 steps
    assert run.decode_tok_s == pytest.approx(4 / DECODE_S_PER_STEP)
    assert run.decode_tok_s_per_seq == pytest.approx(1 / DECODE_S_PER_STEP)
    assert run.total_tok_s == pytest.approx((200 + 44) / (200 * PREFILL_S_PER_TOKEN + 10 * DECODE_S_PER_STEP))


def test_every_batch_size_gets_fresh_prompts_of_the_asked_length():
    clock = Clock()
    llm = ScriptedLLM(clock)
    seen = []
    orig = llm.generate

    def spy(prompts, params, use_tqdm=True):
        seen.append([tuple(p) for p in prompts])
        return orig(prompts, params, use_tqdm)

    llm.generate = spy
    result = run_offline(OfflineConfig(batch_sizes=[1, 3], input_len=12, output_len=4), llm=llm,
                         sampling_params=Params, vocab_ids=list(range(1000, 5000)), clock=clock)
    assert [r["batch_size"] for r in result["runs"]] == [1, 3]
    assert llm.calls == [(2, 2), (1, 1), (1, 4), (3, 1), (3, 4)]  # warm-up, then prefill and full per size
    timed = [p for batch in seen[1:] for p in batch]
    assert all(len(p) == 12 for p in timed)
    assert len(set(timed)) == len(timed)  # no prefix-cache help between the runs
    assert json.loads(json.dumps(result))["schema"] == "tokenfab.bench.offline"


def test_offline_rejects_an_output_too_short_to_measure_decode():
    with pytest.raises(ValueError, match="output_len >= 2"):
        run_offline(OfflineConfig(output_len=1), llm=object(), sampling_params=Params, vocab_ids=[1])


@pytest.mark.slow
def test_offline_on_the_bundled_model_counts_every_token():
    pytest.importorskip("tokenfab.llm")
    result = run_offline(OfflineConfig(batch_sizes=[2], input_len=16, output_len=4))
    run = result["runs"][0]
    assert run["prompt_tokens"] == 2 * 16 and run["output_tokens"] == 2 * 4
    assert run["prefill_tok_s"] > 0 and run["decode_tok_s"] > 0


def test_offline_command_prints_a_table_and_writes_json(monkeypatch, tmp_path, capsys, bundled_tokenizer):
    import tokenfab
    from tokenfab.cli import main

    class CommandLLM(ScriptedLLM):
        def __init__(self, model=None, **engine_kwargs):
            super().__init__(Clock())
            self.engine_kwargs = engine_kwargs

        def get_tokenizer(self):
            return bundled_tokenizer

    monkeypatch.setattr(tokenfab, "LLM", CommandLLM, raising=False)
    out = tmp_path / "off.json"
    assert main(["bench", "offline", "--batch-sizes", "1,2", "--input-len", "8", "--output-len", "3",
                 "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [r["batch_size"] for r in result["runs"]] == [1, 2]
    assert all(r["prompt_tokens"] == 8 * r["batch_size"] for r in result["runs"])
    assert "Decode tok/s" in capsys.readouterr().out

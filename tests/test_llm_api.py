"""The offline API (LLM.generate / LLM.chat) and the CLI, on a tiny random Llama (fast)."""
import json
import math
import subprocess
import sys

import pytest
import torch

from tests.oracle import make_tiny_model
from tokenfab import LLM, SamplingParams
from tokenfab.model.llama import full_logits


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, bundled_tokenizer):
    d = tmp_path_factory.mktemp("tiny-llama")
    make_tiny_model("llama", str(d), bundled_tokenizer)
    return str(d)


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    return LLM(model=tiny_dir, max_model_len=256, num_kv_blocks=128)


def test_output_shape_matches_vllm(tiny):
    out = tiny.generate(["Hello there", [5, 6, 7]], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    assert [o.prompt_token_ids[-3:] for o in out][1] == [5, 6, 7]
    for o in out:
        c = o.outputs[0]
        assert o.finished and c.finish_reason == "length" and len(c.token_ids) == 5
        assert isinstance(c.text, str) and c.logprobs is None


def test_logprobs_hold_the_chosen_token_and_top_n(tiny):
    out = tiny.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0, logprobs=3, ignore_eos=True))[0]
    c = out.outputs[0]
    assert len(c.logprobs) == 4
    for tok, entry in zip(c.token_ids, c.logprobs):
        assert tok in entry and 3 <= len(entry) <= 4
        assert all(lp.logprob <= 0 for lp in entry.values())
        assert entry[tok].logprob == max(lp.logprob for lp in entry.values())  # greedy picks the top
    assert math.isclose(c.cumulative_logprob, sum(e[t].logprob for t, e in zip(c.token_ids, c.logprobs)))


def test_n_samples_with_a_seed_repeat_and_differ_from_each_other(tiny):
    p = SamplingParams(n=3, max_tokens=8, temperature=1.0, seed=123, ignore_eos=True)
    a = tiny.generate([[5, 6, 7]], p)[0]
    b = tiny.generate([[5, 6, 7]], p)[0]
    assert len(a.outputs) == 3
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    assert len({tuple(c.token_ids) for c in a.outputs}) > 1


def test_stop_token_ids_and_min_tokens(tiny):
    free = tiny.generate([[5, 6, 7]], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0].outputs[0]
    stop_at = free.token_ids[2]
    c = tiny.generate([[5, 6, 7]], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True,
                                                  stop_token_ids=[stop_at]))[0].outputs[0]
    first = free.token_ids.index(stop_at)
    assert c.token_ids == free.token_ids[:first + 1]
    assert c.finish_reason == "stop" and c.stop_reason == stop_at


def test_stop_string_cuts_the_text(tiny):
    free = tiny.generate(["Hello"], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0].outputs[0]
    assert len(free.text) > 4
    stop = free.text[2:4]
    c = tiny.generate(["Hello"], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, stop=[stop]))[0].outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == stop
    assert c.text == free.text[:free.text.index(stop)]


def test_chat_applies_the_template_and_rejects_bad_roles(tiny):
    conv = [{"role": "user", "content": "Hi"}]
    out = tiny.chat(conv, SamplingParams(max_tokens=3, temperature=0))[0]
    assert out.prompt_token_ids == tiny.apply_chat_template(conv)
    with pytest.raises(ValueError, match="role 'wizard'"):
        tiny.chat([{"role": "wizard", "content": "x"}])
    with pytest.raises(ValueError, match="non-empty list"):
        tiny.chat([])


def test_bfloat16_logits_stay_close_to_float32(tiny_dir):
    ids = list(range(100, 140))
    f32 = full_logits(LLM(model=tiny_dir, max_model_len=128, num_kv_blocks=16).engine.model, ids)
    bf16 = full_logits(LLM(model=tiny_dir, dtype="bfloat16", max_model_len=128, num_kv_blocks=16).engine.model, ids)
    p32, p16 = torch.softmax(f32, -1), torch.softmax(bf16, -1)
    kl = (p32 * (p32.clamp_min(1e-12).log() - p16.clamp_min(1e-12).log())).sum(-1)
    assert kl.mean() < 0.02
    assert (f32.argmax(-1) == bf16.argmax(-1)).float().mean() > 0.8


def test_priority_policy_runs_lower_values_first(tiny_dir):
    llm = LLM(model=tiny_dir, max_model_len=64, num_kv_blocks=64, max_num_seqs=1, scheduling_policy="priority")
    eng = llm.engine
    eng.add_request("offline", [5, 6], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True), priority=10)
    eng.add_request("online", [5, 7], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True), priority=0)
    finished = []
    while eng.has_unfinished_requests():
        finished += [o.request_id for o in eng.step() if o.finished]
    assert finished == ["online", "offline"]


def run_cli(*args, stdin=None):
    return subprocess.run([sys.executable, "-m", "tokenfab.cli", *args], capture_output=True, text=True,
                          input=stdin, timeout=300)


def test_cli_info_json(tiny_dir):
    r = run_cli("info", tiny_dir, "--json")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["architecture"] == "llama" and info["layers"] == 2
    assert info["kv_bytes_per_token"]["float32"] == 2 * 2 * 2 * 16 * 4


def test_cli_generate_streams_text(tiny_dir):
    r = run_cli("generate", "Hello", "--model", tiny_dir, "--max-tokens", "5", "--ignore-eos", "--max-model-len", "64")
    assert r.returncode == 0, r.stderr
    assert "5 tokens in" in r.stderr


def test_cli_bad_input_is_one_line_and_nonzero(tiny_dir):
    r = run_cli("generate", "Hello", "--model", tiny_dir, "--max-tokens", "0")
    assert r.returncode == 2
    assert "max_tokens" in r.stderr and "Traceback" not in r.stderr
    r = run_cli("info", "/no/such/model.gguf")
    assert r.returncode == 2 and "no such file" in r.stderr and "Traceback" not in r.stderr


def test_a_failing_sequence_ends_alone_with_an_error(tiny):
    eng = tiny.engine
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    eng.add_request("good", [5, 6, 7], params)
    eng.add_request("bad", [5, 6, 8], params)

    def broken(new_ids):
        raise RuntimeError("detokenizer exploded")

    eng.outputs.requests["bad"][0].detokenizer.step = broken
    outs = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            outs[o.request_id] = o
    assert outs["bad"].outputs[0].finish_reason == "error" and "exploded" in outs["bad"].error
    assert outs["good"].outputs[0].finish_reason == "length" and len(outs["good"].outputs[0].token_ids) == 4
    assert eng.block_manager.num_used_blocks() == 0

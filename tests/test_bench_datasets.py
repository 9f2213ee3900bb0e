"""Datasets of `bench serve`: exact token counts with the tokenizer, the shared-prefix
structure, the mixed share of long prompts, jsonl input, and the length distributions."""
import json

import numpy as np
import pytest

from tokenfab.bench.datasets import DatasetConfig, build_dataset
from tokenfab.bench.lengths import parse_length
from tokenfab.bench.tokens import TokenCounter, load_counter


@pytest.fixture(scope="module")
def counter(bundled_tokenizer, bundled_path):
    return TokenCounter(bundled_tokenizer, source=bundled_path)


def chat_ids(tok, messages):
    out = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def test_random_prompts_have_exactly_the_drawn_token_counts(counter, bundled_tokenizer):
    cfg = DatasetConfig(input_len="200", output_len="16", range_ratio=0.5)
    reqs = build_dataset(cfg, counter, 30, seed=3)
    drawn = parse_length("200", 0.5).sample(np.random.default_rng(3), 30)
    assert [r.prompt_len for r in reqs] == drawn
    assert [len(bundled_tokenizer(r.prompt).input_ids) for r in reqs] == drawn
    assert len({r.prompt for r in reqs}) == 30  # no two prompts alike


def test_chat_prompt_length_includes_the_chat_template(counter, bundled_tokenizer):
    reqs = build_dataset(DatasetConfig(endpoint="chat", input_len="64"), counter, 5, seed=0)
    for r in reqs:
        assert r.prompt is None and r.messages[-1]["role"] == "user"
        assert r.prompt_len == len(chat_ids(bundled_tokenizer, r.messages)) == 64


def test_shared_prefix_groups_share_exactly_their_prefix_tokens(counter, bundled_tokenizer):
    cfg = DatasetConfig(name="shared-prefix", num_prefixes=3, prefix_len=50, input_len="20")
    reqs = build_dataset(cfg, counter, 12, seed=1)
    groups = {}
    for r in reqs:
        groups.setdefault(r.tag, []).append(r)
    assert sorted(groups) == ["prefix-0", "prefix-1", "prefix-2"]
    assert all(len(g) == 4 for g in groups.values())
    firsts = []
    for g in groups.values():
        ids = [bundled_tokenizer(r.prompt).input_ids for r in g]
        common = 0
        while all(len(x) > common and x[common] == ids[0][common] for x in ids):
            common += 1
        # 50 shared tokens, then each request's own question diverges right away
        assert common == 50 + len(bundled_tokenizer("").input_ids)
        assert all(r.prompt_len == len(x) == common + 20 for r, x in zip(g, ids))
        firsts.append(ids[0][:common])
    assert len({tuple(f) for f in firsts}) == 3  # the groups' prefixes differ
    assert [r.tag for r in reqs] != sorted(r.tag for r in reqs)  # interleaved, not grouped


def test_shared_prefix_chat_puts_the_prefix_in_the_system_message(counter, bundled_tokenizer):
    cfg = DatasetConfig(name="shared-prefix", endpoint="chat", num_prefixes=2, prefix_len=40, input_len="10")
    reqs = build_dataset(cfg, counter, 4, seed=1)
    for r in reqs:
        system = r.messages[0]
        assert system["role"] == "system"
        assert len(bundled_tokenizer(system["content"], add_special_tokens=False).input_ids) == 40
        assert r.prompt_len == len(chat_ids(bundled_tokenizer, r.messages))
    assert len({r.messages[0]["content"] for r in reqs}) == 2


def test_mixed_has_exactly_the_asked_share_of_long_prompts(counter):
    cfg = DatasetConfig(name="mixed", input_len="32", long_input_len="600", long_fraction=0.2)
    reqs = build_dataset(cfg, counter, 20, seed=5)
    long = [r for r in reqs if r.tag == "long"]
    assert len(long) == 4
    assert all(r.prompt_len == 600 for r in long)
    assert all(r.prompt_len == 32 for r in reqs if r.tag == "short")
    assert [i for i, r in enumerate(reqs) if r.tag == "long"] != [16, 17, 18, 19]  # spread, not appended


def test_jsonl_reads_prompts_cycles_them_and_honours_max_tokens(tmp_path, counter, bundled_tokenizer):
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "Hello there", "max_tokens": 7}\n\n{"prompt": "Count to ten"}\n')
    reqs = build_dataset(DatasetConfig(name="jsonl", path=str(path), output_len="9"), counter, 5, seed=0)
    assert [r.prompt for r in reqs] == ["Hello there", "Count to ten"] * 2 + ["Hello there"]
    assert [r.output_len for r in reqs] == [7, 9, 7, 9, 7]
    assert reqs[1].prompt_len == len(bundled_tokenizer("Count to ten").input_ids)


def test_jsonl_chat_messages_need_the_chat_endpoint(tmp_path, counter):
    path = tmp_path / "c.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    with pytest.raises(ValueError, match="--endpoint chat"):
        build_dataset(DatasetConfig(name="jsonl", path=str(path)), counter, 1, seed=0)
    reqs = build_dataset(DatasetConfig(name="jsonl", path=str(path), endpoint="chat"), counter, 1, seed=0)
    assert reqs[0].messages[0]["content"] == "hi"


def test_jsonl_bad_line_is_reported_by_number(tmp_path, counter):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "ok"}\n{"text": "no prompt"}\n')
    with pytest.raises(ValueError, match="line 2"):
        build_dataset(DatasetConfig(name="jsonl", path=str(path)), counter, 2, seed=0)


def test_missing_tokenizer_falls_back_to_approximate_counts_with_a_warning(tmp_path):
    c = load_counter(str(tmp_path / "no-such-model.gguf"))
    assert not c.exact and "approximate" in c.warning
    reqs = build_dataset(DatasetConfig(input_len="30"), c, 3, seed=0)
    assert [r.prompt_len for r in reqs] == [30, 30, 30]


def test_unknown_dataset_name_lists_the_choices():
    with pytest.raises(ValueError, match="shared-prefix"):
        DatasetConfig.parse_name("sharegpt")
    assert DatasetConfig.parse_name("jsonl:/x/y.jsonl") == ("jsonl", "/x/y.jsonl")


def test_range_ratio_bounds_the_drawn_lengths():
    x = parse_length("100", 0.5).sample(np.random.default_rng(0), 2000)
    assert min(x) >= 50 and max(x) <= 150 and len(set(x)) > 50


@pytest.mark.parametrize("spec,mean", [("uniform:10:30", 20), ("normal:200:20", 200), ("lognormal:100:0.5", 100 * np.exp(0.125))])
def test_length_distributions_have_their_means(spec, mean):
    x = parse_length(spec).sample(np.random.default_rng(0), 20000)
    assert np.mean(x) == pytest.approx(mean, rel=0.02)


@pytest.mark.parametrize("spec", ["abc", "0", "uniform:5", "uniform:9:3", "poisson:3:1", "normal:x:1"])
def test_bad_length_specs_are_rejected(spec):
    with pytest.raises(ValueError):
        parse_length(spec)

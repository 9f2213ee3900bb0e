"""Structured output composes with speculative decoding: drafts are cut at the first token the grammar
forbids, and each verification row is masked with the grammar's state after the drafts before it, so
constrained greedy output is token for token the non-speculative constrained output, every output is
valid, and speculation really ran (its counters move)."""
from __future__ import annotations

import json

import jsonschema
import pytest

from tokenfab import LLM, SamplingParams
from tokenfab.engine.structured import valid_draft_prefix
from tokenfab.structured_output import StructuredOutputParams as Structured

pytestmark = pytest.mark.timeout(900)

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "max_batch_size": 64,
         "adaptive": False}
# Repeated keys in an array of objects: the n-gram proposer finds them in the output so far.
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["items"],
          "properties": {"items": {"type": "array", "minItems": 3, "maxItems": 4, "items": {
              "type": "object", "additionalProperties": False, "required": ["name", "qty", "in_stock"],
              "properties": {"name": {"type": "string", "maxLength": 12},
                             "qty": {"type": "integer", "minimum": 0, "maximum": 99},
                             "in_stock": {"type": "boolean"}}}}}}
PROMPTS = ["List three fruits in a shop as JSON.", "Give a JSON inventory of four tools."]


@pytest.fixture(scope="module")
def spec_llm(bundled_files):
    llm = LLM(loaded=bundled_files, quantization="none", max_model_len=1024, num_kv_blocks=512,
              speculative_config=NGRAM)
    yield llm
    assert llm.engine.block_manager.num_used_blocks() == 0


def prompts(llm) -> list[list[int]]:
    return [llm.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS]


def test_constrained_greedy_with_speculation_equals_constrained_greedy_without(bundled_llm, spec_llm):
    params = SamplingParams(max_tokens=200, temperature=0, structured_output=Structured(json=SCHEMA))
    plain = bundled_llm.generate(prompts(bundled_llm), params, use_tqdm=False)
    before = spec_llm.engine.stats()
    spec = spec_llm.generate(prompts(spec_llm), params, use_tqdm=False)
    after = spec_llm.engine.stats()
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
    for o in spec:
        assert o.outputs[0].finish_reason == "stop", o.outputs[0].text
        jsonschema.validate(json.loads(o.outputs[0].text), SCHEMA)
    assert after.spec_decode_num_drafts > before.spec_decode_num_drafts
    assert after.spec_decode_num_accepted_tokens > before.spec_decode_num_accepted_tokens


def test_sampled_constrained_outputs_with_speculation_validate(spec_llm):
    params = [SamplingParams(max_tokens=200, temperature=1.0, seed=s, structured_output=Structured(json=SCHEMA))
              for s in range(6)]
    before = spec_llm.engine.stats().spec_decode_num_drafts
    outs = spec_llm.generate(prompts(spec_llm)[:1] * len(params), params, use_tqdm=False)
    for o in outs:
        c = o.outputs[0]
        if c.finish_reason == "stop":
            jsonschema.validate(json.loads(c.text), SCHEMA)
    assert spec_llm.engine.stats().spec_decode_num_drafts > before


def test_drafts_are_cut_at_the_first_token_the_grammar_forbids(bundled_llm, bundled_tokenizer):
    eng = bundled_llm.engine
    m = eng.structured.compile(Structured(choice=("yes please", "no"))).matcher()
    yes = bundled_tokenizer.encode("yes please", add_special_tokens=False)
    junk = bundled_tokenizer.encode(" maybe", add_special_tokens=False)
    eos = eng.eos_token_ids
    assert valid_draft_prefix(m, yes + junk, eos) == yes         # past the end of the grammar: cut
    assert valid_draft_prefix(m, yes + eos[:1], eos) == yes      # EOS is left to the target
    assert valid_draft_prefix(m, junk + yes, eos) == []
    assert valid_draft_prefix(m, yes[:1] + junk, eos) == yes[:1]
    assert m.consume_tokens(yes) and m.is_stopped()              # the matcher's state was left as it was

"""Structured output in the engine (offline LLM on the bundled model): outputs always match the spec,
an accept-everything grammar changes nothing, the mask composes with logprobs and the other filters,
and bad specs are ValueErrors before anything is queued."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from tokenfab import SamplingParams
from tokenfab.engine.structured import apply_token_bitmask, fill_bitmask
from tokenfab.structured_output import StructuredOutputParams as Structured

pytestmark = pytest.mark.timeout(900)

# Nested objects, enums, arrays, required fields, numbers with bounds. Strings, arrays and numbers are
# bounded so every document fits in MAX_TOKENS: a fractional number's digits through `multipleOf`,
# which llguidance enforces exactly (no more fraction digits, no runs of trailing zeros). Without it the
# grammar allows any number of digits, and at temperature 1 a small model may write them until
# max_tokens (finish_reason "length"; docs/structured_output.md). The steps are powers of two because
# Python's jsonschema checks multipleOf in binary floating point (2.1266 / 0.0001 is not an integer there).
SCHEMAS = {
    "person": {"type": "object", "additionalProperties": False,
               "required": ["name", "age", "role", "address", "tags"],
               "properties": {
                   "name": {"type": "string", "minLength": 1, "maxLength": 16},
                   "age": {"type": "integer", "minimum": 0, "maximum": 120},
                   "role": {"enum": ["admin", "user", "guest"]},
                   "address": {"type": "object", "additionalProperties": False, "required": ["city", "geo"],
                               "properties": {
                                   "city": {"type": "string", "maxLength": 16},
                                   "geo": {"type": "object", "additionalProperties": False, "required": ["lat", "lon"],
                                           "properties": {"lat": {"type": "number", "minimum": -90, "maximum": 90, "multipleOf": 0.0625},
                                                          "lon": {"type": "number", "minimum": -180, "maximum": 180, "multipleOf": 0.0625}}}}},
                   "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "minItems": 1, "maxItems": 3}}},
    "order": {"type": "object", "additionalProperties": False, "required": ["id", "items", "paid"],
              "properties": {
                  "id": {"type": "integer", "minimum": 1, "maximum": 99999},
                  "items": {"type": "array", "minItems": 1, "maxItems": 3,
                            "items": {"type": "object", "additionalProperties": False, "required": ["sku", "qty", "price"],
                                      "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"},
                                                     "qty": {"type": "integer", "minimum": 1, "maximum": 9},
                                                     "price": {"type": "number", "exclusiveMinimum": 0, "maximum": 1000, "multipleOf": 0.25}}}},
                  "paid": {"type": "boolean"},
                  "note": {"type": ["string", "null"], "maxLength": 20}}},
}
MAX_TOKENS = 256


def prompt_for(llm, name: str) -> list[int]:
    return llm.apply_chat_template([{"role": "user", "content": f"Give an example {name} as JSON."}])


def check_all_valid(llm, schema: dict, name: str, seeds: range) -> None:
    params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=s, structured_output=Structured(json=schema))
              for s in seeds]
    outs = llm.generate([prompt_for(llm, name)] * len(params), params, use_tqdm=False)
    for o in outs:
        c = o.outputs[0]
        assert c.finish_reason == "stop", (c.finish_reason, c.text[-80:])
        jsonschema.validate(json.loads(c.text), schema)


def test_json_schema_outputs_parse_and_validate_at_temperature_1(bundled_llm):
    check_all_valid(bundled_llm, SCHEMAS["person"], "person", range(4))


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SCHEMAS))
def test_json_schema_outputs_parse_and_validate_over_many_seeds(bundled_llm, name):
    check_all_valid(bundled_llm, SCHEMAS[name], name, range(100, 132))


def test_greedy_with_an_accept_anything_regex_equals_unconstrained_greedy(bundled_llm):
    # A JSON schema forces JSON; the spec that allows every text is a regex matching any string
    # (EOS is allowed wherever the regex accepts, so the model may end where it likes).
    prompts = [bundled_llm.apply_chat_template([{"role": "user", "content": q}])
               for q in ("Name three colors.", "What is 2+2?")] + ["The capital of France is"]
    free = SamplingParams(max_tokens=24, temperature=0)
    anything = SamplingParams(max_tokens=24, temperature=0, structured_output=Structured(regex=r"(?s:.*)"))
    want = [o.outputs[0].token_ids for o in bundled_llm.generate(prompts, free, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in bundled_llm.generate(prompts, anything, use_tqdm=False)]
    assert got == want


def test_choice_regex_and_grammar_outputs_match_their_spec(bundled_llm):
    prompt = bundled_llm.apply_chat_template([{"role": "user", "content": "Is the sky blue? Answer yes or no."}])
    specs = [Structured(choice=["yes", "no", "maybe not"]),
             Structured(regex=r"[0-9]{3}-[a-z]{2,5}"),
             Structured(grammar='root ::= "(" num ("," num)* ")"\nnum ::= [1-9] [0-9]?'),       # GBNF
             Structured(grammar='start: "x=" NUM ";"\nNUM: /[0-9]{1,4}/')]                     # Lark
    checks = [lambda t: t in ("yes", "no", "maybe not"),
              lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2,5}", t),
              lambda t: re.fullmatch(r"\([1-9][0-9]?(,[1-9][0-9]?)*\)", t),
              lambda t: re.fullmatch(r"x=[0-9]{1,4};", t)]
    params = [SamplingParams(max_tokens=40, temperature=1.0, seed=s, structured_output=spec)
              for spec in specs for s in range(3)]
    outs = bundled_llm.generate([prompt] * len(params), params, use_tqdm=False)
    for i, o in enumerate(outs):
        assert checks[i // 3](o.outputs[0].text), (specs[i // 3], o.outputs[0].text, o.outputs[0].finish_reason)


def test_json_object_gives_a_json_object(bundled_llm):
    prompt = prompt_for(bundled_llm, "person")
    outs = bundled_llm.generate([prompt] * 2, [SamplingParams(max_tokens=MAX_TOKENS, temperature=t, seed=1,
                                                              structured_output={"json_object": True})
                                               for t in (0.0, 0.7)], use_tqdm=False)
    for o in outs:
        assert o.outputs[0].finish_reason == "stop" and isinstance(json.loads(o.outputs[0].text), dict)


def test_mask_composes_with_logprobs_penalties_and_top_k(bundled_llm, bundled_tokenizer):
    # Logprobs see the masked distribution (as vLLM): the top alternatives are allowed tokens and the
    # allowed tokens' probabilities sum to 1; penalties and top-k act on what the grammar leaves.
    prompt = bundled_llm.apply_chat_template([{"role": "user", "content": "Is the sky green?"}])
    choices = ["yes", "no"]          # few allowed first tokens (y, ye, yes, n, no): all fit in the top 5
    p = SamplingParams(max_tokens=8, temperature=0.8, top_k=3, repetition_penalty=1.3, frequency_penalty=0.5,
                       logprobs=5, seed=3, structured_output=Structured(choice=choices))
    (out,) = bundled_llm.generate(prompt, p, use_tqdm=False)
    c = out.outputs[0]
    assert c.text in choices and c.finish_reason == "stop"
    first = c.logprobs[0]
    starts = {bundled_tokenizer.decode([t]) for t in first}
    assert all(any(ch.startswith(s) for ch in choices) for s in starts), starts
    assert sum(torch.tensor([lp.logprob for lp in first.values()]).exp().tolist()) == pytest.approx(1.0, abs=1e-4)


def test_overlapped_masks_give_the_same_tokens(bundled_llm):
    prompt = prompt_for(bundled_llm, "order")
    p = SamplingParams(max_tokens=24, temperature=1.0, seed=5, structured_output=Structured(json=SCHEMAS["order"]))
    compiler = bundled_llm.engine.structured
    want = bundled_llm.generate(prompt, p, use_tqdm=False)[0].outputs[0].token_ids
    compiler.overlap = True
    try:
        got = bundled_llm.generate(prompt, p, use_tqdm=False)[0].outputs[0].token_ids
    finally:
        compiler.overlap = False
    assert got == want


BAD_SPECS = {
    "unknown type": ({"json": {"type": "frobnicate"}}, "frobnicate"),
    "unsatisfiable bounds": ({"json": {"type": "integer", "minimum": 5, "maximum": 1}}, "minimum"),
    "dangling $ref": ({"json": {"type": "object", "properties": {"a": {"$ref": "#/$defs/nope"}}}}, "nope"),
    "broken regex": ({"regex": "([a-"}, "regex"),
    "broken grammar": ({"grammar": 'root ::= "a" missing_rule'}, "missing_rule"),
}


@pytest.mark.parametrize("case", list(BAD_SPECS))
def test_uncompilable_spec_is_a_value_error_naming_the_problem_and_queues_nothing(bundled_llm, case):
    spec, word = BAD_SPECS[case]
    good = SamplingParams(max_tokens=4)
    with pytest.raises(ValueError, match=re.escape(word)):   # the good first prompt is not queued either
        bundled_llm.generate(["hi", "hi"], [good, SamplingParams(max_tokens=4, structured_output=spec)], use_tqdm=False)
    assert not bundled_llm.engine.has_unfinished_requests()
    assert bundled_llm.engine.block_manager.num_used_blocks() == 0


@pytest.mark.parametrize("spec", [{}, {"json": {}, "regex": "a"}, {"choice": []}, {"regex": ""}, {"json": "not json"},
                                  {"schema": {}}])
def test_malformed_structured_output_params_are_rejected_at_the_boundary(spec):
    with pytest.raises(ValueError, match="structured_output"):
        SamplingParams(structured_output=spec)


def test_compiled_grammars_are_cached_by_the_spec(bundled_llm):
    compiler = bundled_llm.engine.structured
    a = compiler.compile(Structured(json={"type": "object", "properties": {"x": {"type": "integer"}}}))
    b = compiler.compile(Structured(json='{"properties": {"x": {"type": "integer"}}, "type": "object"}'))
    assert a is b
    assert a.matcher() is not b.matcher()          # but each sequence gets its own matcher


def test_mask_forbids_ids_past_the_tokenizer_in_a_padded_vocabulary(bundled_llm):
    # Logits wider than the mask (a padded LM head): the extra ids are never allowed.
    compiler = bundled_llm.engine.structured
    m = compiler.compile(Structured(choice=["yes", "no"])).matcher()
    bitmask = fill_bitmask([(m, [])], compiler.vocab_size)    # no drafts: one row
    logits = torch.zeros(1, compiler.vocab_size + 96)
    out = apply_token_bitmask(logits, [0], bitmask, [2])
    allowed = torch.isfinite(out[0]).nonzero()[:, 0].tolist()
    assert allowed and all(t < compiler.vocab_size for t in allowed)
    assert {bundled_llm.tokenizer.decode([t]) for t in allowed} <= {"y", "ye", "yes", "n", "no"}

"""Incremental detokenizer: equality with a full decode, UTF-8 safety, stop strings, hold-back and release."""
import random

import pytest

from tokenfab.engine.detokenizer import IncrementalDetokenizer
from tokenfab.sampling import SamplingParams

MULTILINGUAL = [
    "Hello, world! 😀🎉 The café costs 5 €.",
    "東京は日本の首都です。北京是中国的首都。",
    "Emoji families 👨‍👩‍👧‍👦 and flags 🇫🇷🇯🇵 need many bytes.",
    "Ünïcödé ÀÉÎÕÜ ñ ß ø ł ğ ş ž — “quotes” …",
    "def f(x):\n    return x ** 2  # 🐍\n",
    "한국어 텍스트와 русский текст и ελληνικά.",
]


def run(tokenizer, output_ids, prompt_ids=(), chunks=None, **params):
    """Feed output_ids in chunks; return (deltas, stop, detokenizer)."""
    detok = IncrementalDetokenizer(tokenizer, list(prompt_ids), SamplingParams(**params))
    chunks = chunks or [1] * len(output_ids)
    deltas, stop, pos = [], None, 0
    for size in chunks:
        delta, stop = detok.step(output_ids[pos:pos + size])
        deltas.append(delta)
        pos += size
        if stop is not None:
            break
    if stop is None:
        deltas.append(detok.finish())
    return deltas, stop, detok


def random_chunks(rng: random.Random, n: int) -> list[int]:
    sizes = []
    while sum(sizes) < n:
        sizes.append(rng.choice([1, 1, 1, 2, 3, 5]))
    return sizes


# ---------------------------------------------------------------------------------------------- equality
@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_concatenated_deltas_equal_full_decode_of_random_token_sequences(bundled_tokenizer, skip_special_tokens):
    tok = bundled_tokenizer
    rng = random.Random(0)
    special = tok.all_special_ids
    for trial in range(150):
        n = rng.randint(1, 40)
        # Random ids produce broken UTF-8 on purpose (lone continuation bytes, cut characters).
        ids = [rng.choice(special) if rng.random() < 0.05 else rng.randrange(len(tok)) for _ in range(n)]
        prompt = [rng.randrange(len(tok)) for _ in range(rng.randint(0, 8))]
        deltas, _, detok = run(tok, ids, prompt, random_chunks(rng, n), skip_special_tokens=skip_special_tokens)
        expected = tok.decode(ids, skip_special_tokens=skip_special_tokens)
        assert "".join(deltas) == expected, (trial, ids)
        assert detok.text == expected


def test_concatenated_deltas_equal_full_decode_of_multilingual_text(bundled_tokenizer):
    tok = bundled_tokenizer
    rng = random.Random(1)
    for text in MULTILINGUAL:
        ids = tok.encode(text)
        prompt = tok.encode("Say something:")
        for _ in range(5):
            deltas, _, _ = run(tok, ids, prompt, random_chunks(rng, len(ids)))
            assert "".join(deltas) == tok.decode(ids) == text


def test_emitted_text_never_contains_half_a_character(bundled_tokenizer):
    tok = bundled_tokenizer
    for text in MULTILINGUAL:
        ids = tok.encode(text)
        assert any("\ufffd" in tok.decode([i]) for i in ids)  # the text really splits characters
        deltas, _, _ = run(tok, ids)
        assert all("\ufffd" not in d for d in deltas)
        assert "".join(deltas) == text


def test_a_cut_character_is_released_at_finish_as_full_decode_shows_it(bundled_tokenizer):
    tok = bundled_tokenizer
    ids = tok.encode("ok 😀")[:-1]  # the emoji's last byte never comes
    detok = IncrementalDetokenizer(tok, [], SamplingParams())
    shown = detok.step(ids)[0]
    assert "\ufffd" not in shown
    assert shown + detok.finish() == tok.decode(ids) == detok.text
    assert detok.text.endswith("\ufffd")


def test_long_runs_of_invalid_bytes_do_not_stall_the_output(bundled_tokenizer):
    tok = bundled_tokenizer
    lone = [i for i in range(len(tok)) if tok.decode([i]) == "\ufffd" and tok.decode([i, i]) == "\ufffd\ufffd"][:1]
    assert lone
    ids = lone * 30 + tok.encode(" fine")
    detok = IncrementalDetokenizer(tok, [], SamplingParams())
    shown = "".join(detok.step([t])[0] for t in ids[:30])
    assert shown.count("\ufffd") >= 20  # released while the run goes on, not only at the end
    assert shown + "".join(detok.step([t])[0] for t in ids[30:]) + detok.finish() == tok.decode(ids)


def sentencepiece_like_tokenizer():
    """A tiny in-memory tokenizer with SentencePiece's "▁" spaces and byte-fallback tokens."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "▁Hello": 2, "▁world": 3, "!": 4, "▁": 5, "<0xE2>": 6, "<0x82>": 7, "<0xAC>": 8}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens(["<s>"])
    return PreTrainedTokenizerFast(tokenizer_object=tok, clean_up_tokenization_spaces=False)


def test_skipped_special_tokens_keep_the_space_context():
    tok = sentencepiece_like_tokenizer()
    output = [3, 1, 1, 3, 4]  # "world", two skipped <s>, " world!"
    deltas, _, _ = run(tok, output, [])
    assert "".join(deltas) == tok.decode(output, skip_special_tokens=True) == "world world!"


def test_leading_spaces_survive_with_sentencepiece_style_tokens():
    tok = sentencepiece_like_tokenizer()
    prompt, output = [2], [3, 5, 6, 7, 8, 4, 3]  # "Hello" + " world €! world"
    deltas, _, _ = run(tok, output, prompt)
    full, head = tok.decode(prompt + output), tok.decode(prompt)
    assert "".join(deltas) == full[len(head):] == " world €! world"
    assert all("\ufffd" not in d for d in deltas)


# ---------------------------------------------------------------------------------------------- stops
def test_stop_string_spanning_tokens_ends_the_text_before_it(bundled_tokenizer):
    tok = bundled_tokenizer
    ids = tok.encode("The answer is forty-two. Thank you, goodbye!")
    stop = "forty-two"
    assert not any(stop in tok.decode([i]) for i in ids)  # no single token holds it
    deltas, matched, detok = run(tok, ids, stop=[stop])
    assert matched == stop and detok.stop_string == stop and detok.finished
    assert "".join(deltas) == detok.text == "The answer is "
    assert tok.decode(detok.output_token_ids).startswith("The answer is forty-two")


def test_include_stop_str_in_output_ends_the_text_after_it(bundled_tokenizer):
    tok = bundled_tokenizer
    ids = tok.encode("The answer is forty-two. Thank you, goodbye!")
    deltas, matched, detok = run(tok, ids, stop=["forty-two"], include_stop_str_in_output=True)
    assert matched == "forty-two"
    assert "".join(deltas) == "The answer is forty-two"


def test_stop_string_inside_one_multi_token_step_drops_later_tokens(bundled_tokenizer):
    tok = bundled_tokenizer
    head, tail = tok.encode("Roses are red"), tok.encode(", violets are blue, sugar is sweet")
    detok = IncrementalDetokenizer(tok, [], SamplingParams(stop=["violets"]))
    delta, matched = detok.step(head + tail)
    assert (delta, matched) == ("Roses are red, ", "violets")
    assert tok.decode(detok.output_token_ids).endswith("violets")  # tokens after the stop are not consumed
    assert len(detok.output_token_ids) < len(head + tail)
    assert detok.step(tok.encode(" more")) == ("", None)


def test_first_stop_string_to_complete_wins(bundled_tokenizer):
    tok = bundled_tokenizer
    ids = tok.encode("alpha beta gamma delta")
    deltas, matched, _ = run(tok, ids, chunks=[len(ids)], stop=["gamma delta", "beta", "alpha beta gamma"])
    assert matched == "beta" and "".join(deltas) == "alpha "
    # Within one token (" gamma"), "amm" completes before "gamma" does, though "gamma" starts first.
    assert " gamma" in [tok.decode([i]) for i in ids]
    deltas, matched, _ = run(tok, ids, stop=["gamma", "amm"])
    assert matched == "amm" and "".join(deltas) == "alpha beta g"


def test_possible_stop_start_is_held_back_then_released(bundled_tokenizer):
    tok = bundled_tokenizer
    text = "we STOP here? no, we STOPPED only at the end"
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok, [], SamplingParams(stop=["STOP!"]))
    shown, held_seen = "", False
    for i, t in enumerate(ids):
        delta, matched = detok.step([t])
        assert matched is None
        shown += delta
        decoded = tok.decode(ids[: i + 1])
        if decoded.endswith("STOP"):
            assert shown == decoded[: -len("STOP")]  # "STOP" might become "STOP!": not shown yet
            held_seen = True
        assert decoded.startswith(shown)
    assert held_seen
    assert shown + detok.finish() == text == detok.text


def test_held_back_tail_is_released_by_finish(bundled_tokenizer):
    tok = bundled_tokenizer
    ids = tok.encode("count down: 3, 2, 1, lift")
    deltas, matched, detok = run(tok, ids, stop=["lift off"])
    assert matched is None
    assert "".join(deltas[:-1]) == "count down: 3, 2, 1, "
    assert deltas[-1] == "lift" and detok.text == tok.decode(ids)


def test_random_stop_strings_cut_text_at_their_first_occurrence(bundled_tokenizer):
    tok = bundled_tokenizer
    rng = random.Random(2)
    for trial in range(60):
        text = rng.choice(MULTILINGUAL) + " " + rng.choice(MULTILINGUAL)
        ids = tok.encode(text)
        a = rng.randrange(len(text) - 1)
        stop = text[a: a + rng.randint(1, 6)]
        include = rng.random() < 0.5
        deltas, matched, detok = run(tok, ids, chunks=random_chunks(rng, len(ids)),
                                     stop=[stop], include_stop_str_in_output=include)
        cut = text.find(stop)
        assert matched == stop, (trial, stop)
        assert "".join(deltas) == detok.text == text[: cut + len(stop) if include else cut], (trial, stop)


def test_stop_strings_do_not_look_at_the_prompt(bundled_tokenizer):
    tok = bundled_tokenizer
    deltas, matched, _ = run(tok, tok.encode(" and more"), tok.encode("END"), stop=["END and"])
    assert matched is None and "".join(deltas) == " and more"

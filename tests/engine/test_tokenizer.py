"""Tokenizer of the real SmolLM2-135M-Instruct directory: digits, chat template, EOS set, incremental
detokenization; checked against transformers (the HF directory and transformers' own GGUF loader)."""
from __future__ import annotations

from pathlib import Path

import pytest

from spd_engine.engine.tokenizer import IncrementalDetokenizer, Tokenizer

MIXED = "Hello 世界! 🙂👍🏽 naïve café — 東京は晴れ. Ünïcödé ok"
NON_DIGIT_TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "  def f(x):\n\treturn x * x  # square\n\n",
    "Ünïcödé, 世界, emoji 🙂👍🏽 and punctuation!?...",
    "<|im_start|>user\nHi there<|im_end|>\n",
    "don't won't they're I'll",
]
DIGIT_TEXTS = ["In 2024, 3.14159 and 1,000,000 items", "x  1", "a   42 b", "row\t  7"]


@pytest.fixture(scope="module")
def tok(smollm2_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(smollm2_dir)


def test_digits_are_split_individually(tok: Tokenizer) -> None:
    ids = tok.encode("In 2024 we paid 31415")
    digit_tokens = [tok.decode([i]) for i in ids if any(c.isdigit() for c in tok.decode([i]))]
    assert digit_tokens == list("202431415")
    # The Digits pre-tokenizer runs before the byte-level regex, so spaces before a number stay one run.
    assert [tok.decode([i]) for i in tok.encode("x  1")] == ["x", "  ", "1"]


def test_round_trip(tok: Tokenizer) -> None:
    for text in NON_DIGIT_TEXTS + DIGIT_TEXTS + [MIXED]:
        assert tok.decode(tok.encode(text)) == text


def test_eos_ids_are_im_end_then_endoftext(tok: Tokenizer) -> None:
    im_end, endoftext = tok.backend.token_to_id("<|im_end|>"), tok.backend.token_to_id("<|endoftext|>")
    assert tok.eos_ids == (im_end, endoftext)


def test_chat_template_for_one_user_turn(tok: Tokenizer) -> None:
    expected = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
                "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")
    assert tok.chat_text("What is 2+2?") == expected
    ids = tok.chat_ids("What is 2+2?")
    assert ids == tok.encode(expected)
    im_start = tok.backend.token_to_id("<|im_start|>")
    assert ids[0] == im_start and ids.count(im_start) == 3  # special tokens are single ids, not text


def test_incremental_detokenizer_never_splits_a_character(tok: Tokenizer) -> None:
    ids = tok.encode(MIXED)
    detok = IncrementalDetokenizer(tok)
    pieces = [detok.push(i) for i in ids]
    assert "" in pieces  # some tokens carry only part of a character: the test exercises holding back
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) + detok.flush() == tok.decode(ids) == MIXED


def test_incremental_detokenizer_flushes_an_unfinished_character(tok: Tokenizer) -> None:
    ids = tok.encode("ok 世界")
    # Drop the last token: the last character's bytes are incomplete and must not be emitted by push().
    detok = IncrementalDetokenizer(tok)
    pushed = "".join(detok.push(i) for i in ids[:-1])
    assert "\ufffd" not in pushed and pushed + detok.flush() == tok.decode(ids[:-1])
    assert tok.decode(ids[:-1]).endswith("\ufffd")


def test_incremental_detokenizer_skip_special_tokens(tok: Tokenizer) -> None:
    ids = tok.chat_ids("Hi 🙂") + tok.encode("Hello!<|im_end|>")
    detok = IncrementalDetokenizer(tok, skip_special_tokens=True)
    text = "".join(detok.push(i) for i in ids) + detok.flush()
    assert text == tok.decode(ids, skip_special_tokens=True) and "<|im_end|>" not in text


def test_matches_transformers_on_our_directory(tok: Tokenizer, smollm2_dir: Path) -> None:
    transformers = pytest.importorskip("transformers")
    ref = transformers.AutoTokenizer.from_pretrained(str(smollm2_dir))
    for text in NON_DIGIT_TEXTS + DIGIT_TEXTS + [MIXED]:
        assert tok.encode(text) == ref(text, add_special_tokens=False).input_ids, text
    messages = [{"role": "user", "content": "Hi"}]
    assert tok.chat_text("Hi") == ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert set(tok.eos_ids) == set(ref.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"]))


@pytest.mark.slow
def test_matches_transformers_gguf_tokenizer_on_non_digit_text(tok: Tokenizer, smollm2_gguf: Path) -> None:
    # transformers' GGUF import drops the Digits pre-tokenizer, so only non-digit text must agree;
    # on whitespace before a digit it differs (ours keeps the space run whole, as SmolLM2 was trained).
    transformers = pytest.importorskip("transformers")
    ref = transformers.AutoTokenizer.from_pretrained(str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name)
    for text in NON_DIGIT_TEXTS + [MIXED]:
        assert tok.encode(text) == ref(text, add_special_tokens=False).input_ids, text
    assert tok.encode("x  1") != ref("x  1", add_special_tokens=False).input_ids

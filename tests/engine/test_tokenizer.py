"""Tokenizer of the real SmolLM2-135M-Instruct directory: digits, chat template, EOS set, incremental
detokenization; checked against transformers (the HF directory and transformers' own GGUF loader)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from spd_engine.engine.model.tokenizer import IncrementalDetokenizer, Tokenizer

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


# ---- chat templates from either file, multi-turn chats, text without special tokens ----

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 🙂"},
        {"role": "assistant", "content": "Hello! How can I help?"}, {"role": "user", "content": "2+2?"}]


def tokenizer_copy(src: Path, dst: Path, template_in_jinja: bool) -> Path:
    """The tokenizer files of `src`, with the chat template moved into chat_template.jinja if asked."""
    import json
    import shutil

    dst.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        shutil.copyfile(src / name, dst / name)
    if template_in_jinja:
        cfg = json.loads((dst / "tokenizer_config.json").read_text())
        (dst / "chat_template.jinja").write_text(cfg.pop("chat_template"))
        (dst / "tokenizer_config.json").write_text(json.dumps(cfg))
    return dst


def test_chat_template_jinja_file_is_read_as_transformers_reads_it(tmp_path, tok, smollm2_dir) -> None:
    transformers = pytest.importorskip("transformers")
    d = tokenizer_copy(smollm2_dir, tmp_path / "tok", template_in_jinja=True)
    assert "chat_template" not in (d / "tokenizer_config.json").read_text()
    ours = Tokenizer.from_dir(d)
    assert ours.chat_template == tok.chat_template
    ref = transformers.AutoTokenizer.from_pretrained(str(d))
    for messages in (CHAT[:2], CHAT):
        want = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert ours.chat_text_messages(messages) == want
        assert ours.chat_ids_messages(messages) == ref(want, add_special_tokens=False).input_ids
    whole = ref.apply_chat_template(CHAT[:3], tokenize=False, add_generation_prompt=False)
    assert ours.chat_text_messages(CHAT[:3], add_generation_prompt=False) == whole


def test_jinja_file_wins_and_named_templates(tmp_path, smollm2_dir) -> None:
    import json

    d = tokenizer_copy(smollm2_dir, tmp_path / "tok", template_in_jinja=False)
    (d / "chat_template.jinja").write_text("{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}")
    assert Tokenizer.from_dir(d).chat_text("x") == "[user]x"  # transformers prefers the .jinja file too
    (d / "chat_template.jinja").unlink()
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D{{ bos_token }}"}]
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert Tokenizer.from_dir(d).chat_text("x") == "D" + Tokenizer.from_dir(d).special_tokens["bos_token"]
    del cfg["chat_template"]
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="no chat template"):
        Tokenizer.from_dir(d).chat_ids("x")


def test_bad_messages_and_template_errors_are_value_errors(tok) -> None:
    with pytest.raises(ValueError, match="message 1"):
        tok.chat_ids_messages([{"role": "user", "content": "a"}, {"content": "b"}])
    with pytest.raises(ValueError, match="non-empty list"):
        tok.chat_ids_messages([])
    strict = Tokenizer(tok.backend, "{{ raise_exception('roles must alternate') }}", tok.eos_ids, tok.special_tokens)
    with pytest.raises(ValueError, match="roles must alternate"):
        strict.chat_ids("x")


def test_text_leaves_special_tokens_out(tok) -> None:
    ids = tok.encode("The answer is 4.<|im_end|>")
    assert tok.decode(ids).endswith("<|im_end|>")
    assert tok.text(ids) == "The answer is 4."


def test_sentencepiece_only_directory_without_the_package_names_it(tmp_path, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "sentencepiece", None)  # as where it is not installed
    (tmp_path / "tokenizer.model").write_bytes(b"\x00")
    with pytest.raises(ValueError, match=r"needs the sentencepiece package \(pip install sentencepiece\)"):
        Tokenizer.from_dir(tmp_path)


def test_incremental_detokenizer_on_a_metaspace_tokenizer() -> None:
    """A SentencePiece-style decoder (Metaspace: a leading '▁' becomes a space, the first one dropped)."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers

    vocab = {"<unk>": 0, "</s>": 1, "▁hello": 2, "▁wor": 3, "ld": 4, "▁": 5, "<0xE4>": 6, "<0xB8>": 7, "<0x96>": 8}
    backend = Backend(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Sequence([decoders.Metaspace(), decoders.ByteFallback(), decoders.Fuse()])
    backend.add_special_tokens(["</s>"])
    tok = Tokenizer(backend, None, (1,), {"eos_token": "</s>"})
    ids = [2, 3, 4, 5, 6, 7, 8, 1]  # "hello world 世" then EOS; 世 arrives in three byte tokens
    detok = IncrementalDetokenizer(tok, skip_special_tokens=True)
    pieces = [detok.push(i) for i in ids]
    assert pieces[4:6] == ["", ""] and "\ufffd" not in "".join(pieces)
    assert "".join(pieces) + detok.flush() == tok.text(ids) == "hello world 世"

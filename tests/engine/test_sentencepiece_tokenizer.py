"""A SentencePiece `.model` as a model's tokenizer: ids and text exactly SentencePiece's own (where the
package is installed; a tiny model is trained in the test), incremental pieces that join into the
decoded text, and a one-line refusal naming the package where it is not installed."""
from __future__ import annotations

import io
import json
import sys

import pytest
from tokenizers import Tokenizer as Backend
from tokenizers import decoders, models, pre_tokenizers

from spd_engine.engine.model.sentencepiece_backend import WindowDecodeStream
from spd_engine.engine.model.tokenizer import IncrementalDetokenizer, Tokenizer

TEXT = ["hello world, the quick brown fox jumps over the lazy dog", "héllo wörld 日本語 über naïve café"] * 30


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory):
    """A 300-piece unigram model with byte fallback (bos 1, eos 2), trained here in ~0.1 s."""
    spm = pytest.importorskip("sentencepiece")
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(TEXT), model_writer=buf, vocab_size=300,
                                   model_type="unigram", byte_fallback=True, hard_vocab_limit=False, minloglevel=2)
    path = tmp_path_factory.mktemp("sp") / "tok.model"
    path.write_bytes(buf.getvalue())
    return path


def test_without_the_package_a_model_file_is_refused_naming_it(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "sentencepiece", None)
    (tmp_path / "tok.model").write_bytes(b"\x00")
    with pytest.raises(ValueError) as err:
        Tokenizer.from_dir(tmp_path / "tok.model")
    assert str(err.value) == (f"{tmp_path / 'tok.model'} is a SentencePiece model: reading it needs the "
                              "sentencepiece package (pip install sentencepiece)")


def test_ids_and_text_are_sentencepieces_own(sp_model):
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor(model_file=str(sp_model))
    tok = Tokenizer.from_dir(sp_model)
    assert tok.vocab_size == sp.get_piece_size() and tok.eos_ids == (sp.eos_id(),) and tok.bos_id == sp.bos_id()
    for text in ("hello world", "日本語 and an emoji 🙂 (byte pieces)", "  leading spaces"):
        ids = tok.encode(text)
        assert ids == sp.encode(text) and tok.decode(ids) == sp.decode(ids)
    assert tok.decode([sp.bos_id(), *sp.encode("hi"), sp.eos_id()]) == "<s>hi</s>"
    assert tok.encode("<s>hi</s> there") == [sp.bos_id(), *sp.encode("hi"), sp.eos_id(), *sp.encode(" there")]
    assert tok.text([*sp.encode("hi"), sp.eos_id()]) == "hi"
    assert tok.decode([*sp.encode("hi"), sp.get_piece_size() + 3]) == "hi"  # a padded vocabulary's row: nothing
    assert tok.backend.token_to_id("</s>") == sp.eos_id() and tok.backend.token_to_id("no such piece") is None


def test_streamed_pieces_join_into_the_text(sp_model):
    tok = Tokenizer.from_dir(sp_model)
    ids = tok.encode("hello 日本語 world 🙂 über café")
    detok = IncrementalDetokenizer(tok, skip_special_tokens=True)
    pieces = [detok.push(i) for i in ids]
    assert "".join(pieces) + detok.flush() == tok.text(ids) == "hello 日本語 world 🙂 über café"
    assert all("\ufffd" not in p for p in pieces)  # a byte-fallback character is held until complete


def test_a_directory_with_tokenizer_model_and_its_config(sp_model, tmp_path):
    (tmp_path / "tokenizer.model").write_bytes(sp_model.read_bytes())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"add_bos_token": True}))
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.encode("hello")[0] == tok.bos_id == 1


def test_a_file_that_is_no_model_is_refused(tmp_path):
    pytest.importorskip("sentencepiece")
    (tmp_path / "bad.model").write_bytes(b"not a model")
    with pytest.raises(ValueError, match="not a SentencePiece model"):
        Tokenizer.from_dir(tmp_path / "bad.model")


def test_window_stream_matches_the_librarys_decode_stream():
    """The window decoder (any backend) on a Metaspace + byte-fallback tokenizer gives the pieces
    of the tokenizers library's own DecodeStream."""
    from tokenizers.decoders import DecodeStream

    vocab = {"<unk>": 0, "▁hello": 1, "▁wor": 2, "ld": 3, "▁": 4, "<0xE4>": 5, "<0xB8>": 6, "<0x96>": 7, "!": 8}
    backend = Backend(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Metaspace()])
    ids = [1, 2, 3, 4, 5, 6, 7, 8, 1]
    ours, theirs = WindowDecodeStream(), DecodeStream(skip_special_tokens=False)
    got = [ours.step(backend, i) or "" for i in ids]
    want = [theirs.step(backend, i) or "" for i in ids]
    assert "".join(got) == "".join(want) == backend.decode(ids) and got == want

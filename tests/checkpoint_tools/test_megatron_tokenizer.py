"""A Megatron checkpoint's tokenizer carried: `import-megatron --tokenizer` (a directory or a
tokenizer.json) copies it into the engine checkpoint, `spd generate` then speaks text with it; a
model with real weights and no tokenizer refuses text naming --tokenizer, and `--model` on a
Megatron directory names the command that imports it."""
from __future__ import annotations

import json

import pytest
from ckpt_helpers import tiny_state
from tiny_tokenizer import write_tiny_tokenizer

from spd_engine.checkpoint_tools import megatron_dcp
from spd_engine.engine.model.model_config import tiny_config
from spd_engine.engine.model.tokenizer import Tokenizer
from spd_engine.tools.cli import main

GENERATE = ["generate", "--mode", "ar", "--stages", "1", "--threads", "1", "--max-new-tokens", "3"]


@pytest.fixture
def megatron(tmp_path, monkeypatch):
    """A Megatron-LM --save layout of a tiny Llama (iter tracker + release/) and a tokenizer directory."""
    monkeypatch.setenv("SPD_CACHE", str(tmp_path / "cache"))
    cfg = tiny_config("llama")
    megatron_dcp.export_megatron(tmp_path / "meg", cfg, tiny_state(cfg), release_layout=True)
    write_tiny_tokenizer(tmp_path / "tok")
    (tmp_path / "tok" / "vocab.json").write_text("{}")  # another vocabulary beside a named file is not carried
    return tmp_path


def test_tokenizer_directory_is_carried_and_generate_speaks_text(megatron, capsys, one_thread):
    assert main(["convert", "import-megatron", str(megatron / "meg"), str(megatron / "e"),
                 "--pipeline-model-parallel-size", "2", "--tokenizer", str(megatron / "tok")]) == 0
    assert "tokenizer " + str(megatron / "tok") in capsys.readouterr().out
    assert (megatron / "e" / "tokenizer.json").read_bytes() == (megatron / "tok" / "tokenizer.json").read_bytes()
    assert main([*GENERATE, "--model", str(megatron / "e"), "--prompt", "hello world", "--json"]) == 0
    rec = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    tok = Tokenizer.from_dir(megatron / "tok")
    assert rec["text"] is not None and rec["text"] == tok.text(rec["token_ids"])


def test_a_tokenizer_json_file_lands_as_the_models_own(megatron, capsys):
    assert main(["convert", "import-megatron", str(megatron / "meg"), str(megatron / "e"),
                 "--tokenizer-model", str(megatron / "tok" / "tokenizer.json")]) == 0
    assert f"tokenizer {megatron / 'tok' / 'tokenizer.json'}" in capsys.readouterr().out
    names = sorted(p.name for p in (megatron / "e").iterdir() if not p.name.endswith(".safetensors"))
    assert names == ["index.json", "tokenizer.json", "tokenizer_config.json"]  # not the vocab.json beside it
    assert Tokenizer.from_dir(megatron / "e").eos_ids == (2,)


def test_without_a_tokenizer_text_is_refused_naming_the_flag(megatron, capsys, one_thread):
    assert main(["convert", "import-megatron", str(megatron / "meg"), str(megatron / "e")]) == 0
    assert "no tokenizer carried" in capsys.readouterr().err
    assert main([*GENERATE, "--model", str(megatron / "e"), "--prompt", "hello"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "has no tokenizer" in err and "--tokenizer PATH" in err
    assert main([*GENERATE, "--load", str(megatron / "e"), "--tokenizer", str(megatron / "tok"),
                 "--prompt", "hello", "--json", "--quiet"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["text"] is not None


def test_random_models_keep_their_byte_prompts(capsys, one_thread):
    assert main([*GENERATE, "--model", "random:tiny-llama", "--prompt", "hello", "--quiet"]) == 0


@pytest.mark.parametrize("given,message", [
    ("missing", "tokenizer not found"),
    ("big", "has 120 tokens, more than the model's vocabulary of 96"),
    ("notes.txt", "a tokenizer is an HF directory, a tokenizer.json or a SentencePiece .model"),
])
def test_a_bad_tokenizer_is_refused_before_anything_is_written(megatron, capsys, given, message):
    write_tiny_tokenizer(megatron / "big", vocab_size=120)
    (megatron / "notes.txt").write_text("x")
    assert main(["convert", "import-megatron", str(megatron / "meg"), str(megatron / "e"),
                 "--tokenizer", str(megatron / given)]) == 2
    assert message in capsys.readouterr().err and not (megatron / "e").exists()
    assert main([*GENERATE, "--model", "random:tiny-llama", "--tokenizer", str(megatron / given), "--prompt", "x"]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("layout", ["tracker", "iter", "dcp"])
def test_model_on_a_megatron_directory_names_the_import(megatron, capsys, layout):
    src = {"tracker": megatron / "meg", "iter": megatron / "lm", "dcp": megatron / "meg" / "release"}[layout]
    if layout == "iter":
        (src / "iter_0000100").mkdir(parents=True)
    assert main([*GENERATE, "--model", str(src), "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert f"spd convert import-megatron {src} DST" in err and len(err.strip().splitlines()) == 1


def test_a_sentencepiece_model_is_carried_and_speaks(tmp_path, monkeypatch, capsys, one_thread):
    """Megatron-LM's --tokenizer-model file: a SentencePiece .model (where the package is installed)."""
    spm = pytest.importorskip("sentencepiece")
    import io

    monkeypatch.setenv("SPD_CACHE", str(tmp_path / "cache"))
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(["hello world, a tiny model", "héllo 日本語"] * 20),
                                   model_writer=buf, vocab_size=290, byte_fallback=True, hard_vocab_limit=False,
                                   minloglevel=2)
    (tmp_path / "sp.model").write_bytes(buf.getvalue())
    sp = spm.SentencePieceProcessor(model_file=str(tmp_path / "sp.model"))
    cfg = tiny_config("llama", vocab_size=320)  # SentencePiece's byte pieces alone are 256
    megatron_dcp.export_megatron(tmp_path / "meg", cfg, tiny_state(cfg))
    assert main(["convert", "import-megatron", str(tmp_path / "meg"), str(tmp_path / "e"),
                 "--tokenizer-model", str(tmp_path / "sp.model")]) == 0
    assert (tmp_path / "e" / "tokenizer.model").read_bytes() == buf.getvalue()
    capsys.readouterr()
    assert main([*GENERATE, "--model", str(tmp_path / "e"), "--prompt", "hello 日本", "--json", "--quiet"]) == 0
    rec = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rec["text"] == sp.decode([i for i in rec["token_ids"] if i < sp.get_piece_size()])  # past it: padding


@pytest.mark.parametrize("action", ["hf2engine", "engine2hf", "hf2mcore"])
def test_the_engine_conversions_on_a_megatron_directory_name_the_import(megatron, capsys, action):
    assert main(["convert", action, str(megatron / "meg"), str(megatron / "out")]) == 2
    assert f"spd convert import-megatron {megatron / 'meg'} DST" in capsys.readouterr().err

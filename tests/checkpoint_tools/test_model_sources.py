"""Finding models: an id in the local Hugging Face cache (huggingface_hub's own layout, offline), the
conversion cache keyed on content, and `spd generate` by model id with a chat_template.jinja tokenizer."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from ckpt_helpers import write_tiny_hf
from safetensors.torch import load_file, save_file

from spd_engine.checkpoint_tools import convert_cache, hf_cache
from spd_engine.engine.model.model_config import tiny_config
from spd_engine.engine.model.tokenizer import Tokenizer
from spd_engine.tools.cli import main
from spd_engine.tools.model_args import resolve_model

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def hub_layout(cache: Path, repo_id: str, src: Path, commit: str = COMMIT, ref: str | None = "main") -> Path:
    """`src`'s files stored the way huggingface_hub stores a download: blobs, snapshot links, refs."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snap = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True)
    snap.mkdir(parents=True)
    for f in sorted(src.iterdir()):
        data = f.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snap / f.name).symlink_to(os.path.relpath(blob, snap))
    if ref is not None:
        (repo / "refs").mkdir()
        (repo / "refs" / ref).write_text(commit)
    return snap


@pytest.fixture
def caches(tmp_path, monkeypatch):
    """An empty hub cache and engine cache, both under tmp_path, selected through the environment."""
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("SPD_CACHE", str(tmp_path / "spd"))
    (tmp_path / "hub").mkdir()
    return tmp_path


def test_hub_cache_location_follows_huggingface_hub(monkeypatch, tmp_path):
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    assert hf_cache.hub_cache() == tmp_path / "home" / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "x"))
    assert hf_cache.hub_cache() == tmp_path / "x"


def test_snapshot_is_the_one_huggingface_hub_finds(caches):
    huggingface_hub = pytest.importorskip("huggingface_hub")
    write_tiny_hf(caches / "src", tiny_config("llama"))
    hub_layout(caches / "hub", "org/tiny", caches / "src")
    ours = hf_cache.find_snapshot("org/tiny")
    theirs = huggingface_hub.snapshot_download("org/tiny", cache_dir=caches / "hub", local_files_only=True)
    assert ours == Path(theirs)
    assert [r.repo_id for r in huggingface_hub.scan_cache_dir(caches / "hub").repos] == ["org/tiny"]
    assert hf_cache.find_snapshot(f"org/tiny@{COMMIT}") == ours


def test_misses_say_where_they_looked(caches):
    with pytest.raises(ValueError, match=r"not found: looked in the Hugging Face cache .*models--org--none"):
        hf_cache.find_snapshot("org/none")
    with pytest.raises(ValueError, match="org/none.*not a path, a built-in model"):
        resolve_model("org/none")
    write_tiny_hf(caches / "src", tiny_config("llama"))
    hub_layout(caches / "hub", "org/tiny", caches / "src")
    with pytest.raises(ValueError, match="revision 'v2' is not in"):
        hf_cache.find_snapshot("org/tiny@v2")


def test_refs_and_links_resolve_only_inside_the_cache(caches):
    """A ref, a revision or a snapshot link that leads out of the model's cache directory is refused."""
    write_tiny_hf(caches / "src", tiny_config("llama"))
    snap = hub_layout(caches / "hub", "org/tiny", caches / "src")
    repo = snap.parents[1]
    hf_cache.find_snapshot("org/tiny")  # the well-formed cache is found
    outside = caches / "elsewhere"
    shutil.copytree(caches / "src", outside)
    (repo / "refs" / "evil").write_text(os.path.relpath(outside, repo / "snapshots"))
    with pytest.raises(ValueError, match="does not hold a commit hash"):
        hf_cache.find_snapshot("org/tiny@evil")
    with pytest.raises(ValueError, match="leads outside the Hugging Face cache"):
        hf_cache.find_snapshot("org/tiny@../../../elsewhere/config.json")
    (snap / "config.json").unlink()
    (snap / "config.json").symlink_to(outside / "config.json")
    with pytest.raises(ValueError, match=r"config.json leads outside the Hugging Face cache"):
        hf_cache.find_snapshot("org/tiny")
    shutil.rmtree(snap)
    snap.symlink_to(outside, target_is_directory=True)  # the whole snapshot somewhere else
    with pytest.raises(ValueError, match="leads outside"):
        hf_cache.find_snapshot("org/tiny")


def test_conversion_cache_is_keyed_on_content(caches, capsys):
    cfg = tiny_config("qwen3")
    write_tiny_hf(caches / "a", cfg)
    first, _ = resolve_model(str(caches / "a"))
    assert "converting" in capsys.readouterr().err
    shutil.copytree(caches / "a", caches / "b")  # the same content under another path: no new conversion
    assert resolve_model(str(caches / "b"))[0] == first and "converting" not in capsys.readouterr().err
    state = load_file(str(caches / "b" / "model.safetensors"))
    state["model.norm.weight"] = state["model.norm.weight"] * 2
    save_file(state, str(caches / "b" / "model.safetensors"))  # an updated directory converts again
    second, _ = resolve_model(str(caches / "b"))
    assert second != first and "converting" in capsys.readouterr().err
    assert convert_cache.hf_content_key(caches / "a") != convert_cache.hf_content_key(caches / "b")
    assert not list((caches / "spd" / "engine").glob(".*partial*"))


def chat_model_in_hub(caches: Path, smollm2_dir: Path, zero_final_norm: bool = False) -> Path:
    """A small random Llama with SmolLM2's tokenizer, its chat template in chat_template.jinja, in the hub cache."""
    cfg = tiny_config("llama", vocab_size=49152, num_layers=2, eos_token_ids=(2,), tie_embeddings=False)
    state = write_tiny_hf(caches / "src", cfg)
    if zero_final_norm:  # every logit 0: greedy picks id 0, <|endoftext|>, an EOS of SmolLM2
        state["model.norm.weight"] = torch.zeros_like(state["model.norm.weight"])
        save_file(state, str(caches / "src" / "model.safetensors"))
    for name in ("tokenizer.json", "special_tokens_map.json", "generation_config.json"):
        shutil.copyfile(smollm2_dir / name, caches / "src" / name)
    tok_cfg = json.loads((smollm2_dir / "tokenizer_config.json").read_text())
    (caches / "src" / "chat_template.jinja").write_text(tok_cfg.pop("chat_template"))
    (caches / "src" / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    return hub_layout(caches / "hub", "org/tiny-chat", caches / "src")


def test_generate_by_model_id_with_a_jinja_chat_template(caches, smollm2_dir, capsys, one_thread):
    snap = chat_model_in_hub(caches, smollm2_dir)
    chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "Name a colour."}]
    (caches / "chat.json").write_text(json.dumps(chat))
    assert main(["generate", "--model", "org/tiny-chat", "--mode", "ar", "--stages", "1", "--threads", "1",
                 "--messages-file", str(caches / "chat.json"), "--max-new-tokens", "6", "--json"]) == 0
    rec = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    tok = Tokenizer.from_dir(snap)
    assert rec["text"] == tok.text(rec["token_ids"]) and len(rec["token_ids"]) == rec["tokens"]
    assert rec["model"].startswith(str(caches / "spd" / "engine" / "org--tiny-chat-"))


def test_streamed_and_returned_text_have_no_special_tokens(caches, smollm2_dir, capsys, one_thread):
    chat_model_in_hub(caches, smollm2_dir, zero_final_norm=True)
    assert main(["generate", "--model", "org/tiny-chat", "--mode", "ar", "--stages", "1", "--threads", "1",
                 "--prompt", "Hi", "--chat", "--max-new-tokens", "4", "--json"]) == 0
    out = capsys.readouterr().out
    rec = json.loads(out.strip().splitlines()[-1])
    assert rec["token_ids"] == [0] and rec["text"] == ""  # the EOS is a token, not text
    assert "<|endoftext|>" not in out

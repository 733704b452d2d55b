"""hf2mcore / mcore2hf: bit-identical round trips over stage and TP splits, HF parity, clear errors."""
from __future__ import annotations

import json

import pytest
import torch
from ckpt_helpers import ARCHS, assert_same_tensors, write_tiny_hf
from safetensors.torch import save_file

from spd_engine.checkpoint_tools import hf, shard
from spd_engine.engine.model import checkpoint as ckpt
from spd_engine.engine.model.model_config import tiny_config


@pytest.mark.parametrize("arch", ARCHS)
def test_round_trip_bit_identical_for_every_split(tmp_path, arch):
    cfg = tiny_config(arch)
    src = tmp_path / "hf"
    source = write_tiny_hf(src, cfg)
    hashes = set()
    for pp in (1, 2, 3, 4):
        for tp in (1, 2):
            mid, out = tmp_path / f"e{pp}{tp}", tmp_path / f"h{pp}{tp}"
            index = shard.hf2mcore(src, mid, pp=pp, tp=tp)
            assert index.n == pp and index.tp == tp and len(index.shards) == pp * tp
            shard.mcore2hf(mid, out)
            assert_same_tensors(hf.read_hf_state(out), source)
            assert hf.read_hf_config(out)[0] == cfg
            if tp == 1:
                hashes.add(index.content_hash)
    assert len(hashes) == 1


def test_bf16_round_trip_and_dtype_cast(tmp_path):
    cfg = tiny_config("qwen3")
    source = write_tiny_hf(tmp_path / "hf", cfg, dtype=torch.bfloat16)
    index = shard.hf2mcore(tmp_path / "hf", tmp_path / "e", stage_layers="2,4", tp=2)
    assert index.dtype == "bfloat16"
    shard.mcore2hf(tmp_path / "e", tmp_path / "out")
    assert_same_tensors(hf.read_hf_state(tmp_path / "out"), source)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    shard.mcore2hf(tmp_path / "e", tmp_path / "f32", dtype=torch.float32)
    assert_same_tensors(hf.read_hf_state(tmp_path / "f32"), {k: v.float() for k, v in source.items()})


def test_sharded_hf_dir_tokenizer_and_config_fields(tmp_path):
    cfg = tiny_config("llama")
    src = tmp_path / "hf"
    source = write_tiny_hf(src, cfg, max_shard_bytes=60_000)
    assert (src / hf.INDEX_FILE).is_file() and len(hf.weight_files(src)) > 2
    raw = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**raw, "pad_token_id": 5}))
    shard.hf2mcore(src, tmp_path / "e", pp=2)
    assert (tmp_path / "e" / "tokenizer_config.json").is_file()
    shard.mcore2hf(tmp_path / "e", tmp_path / "out", max_shard_bytes=100_000)
    assert len(hf.weight_files(tmp_path / "out")) > 1
    assert_same_tensors(hf.read_hf_state(tmp_path / "out"), source)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["pad_token_id"] == 5
    assert (tmp_path / "out" / "tokenizer_config.json").read_text() == (src / "tokenizer_config.json").read_text()


@pytest.mark.parametrize("arch", ARCHS)
def test_converted_stages_match_transformers_logits(tmp_path, arch):
    """The trusted reference: HF transformers on the HF directory vs our stages on the conversion."""
    transformers = pytest.importorskip("transformers")
    cfg = tiny_config(arch)
    write_tiny_hf(tmp_path / "hf", cfg)
    shard.hf2mcore(tmp_path / "hf", tmp_path / "e", pp=3, tp=1)
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", torch_dtype=torch.float32).eval()
    tokens = torch.randint(0, cfg.vocab_size, (1, 9))
    stages = [ckpt.load_stage_model(tmp_path / "e", p) for p in range(3)]
    with torch.no_grad():
        want = ref(tokens).logits
        h = stages[0].embed(tokens)
        for s in stages:
            h = s.forward_layers(h, s.new_cache(1, 9), 0)[0]
        got = stages[-1].logits(h)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


# ---- bad inputs ----

@pytest.fixture
def tiny_hf(tmp_path):
    cfg = tiny_config("llama")
    write_tiny_hf(tmp_path / "hf", cfg)
    return tmp_path / "hf"


def test_split_errors(tmp_path, tiny_hf):
    with pytest.raises(ValueError, match="7 stages is more than the model's 6 layers"):
        shard.hf2mcore(tiny_hf, tmp_path / "e", pp=7)
    with pytest.raises(ValueError, match=r"sum to 5, but the model has 6 layers"):
        shard.hf2mcore(tiny_hf, tmp_path / "e", stage_layers="2,2,1")
    with pytest.raises(ValueError, match="at least one layer"):
        shard.hf2mcore(tiny_hf, tmp_path / "e", stage_layers="6,0")
    with pytest.raises(ValueError, match="--tp 3 does not divide"):
        shard.hf2mcore(tiny_hf, tmp_path / "e", tp=3)
    assert not (tmp_path / "e").exists()  # every check runs before anything is written


def test_bad_hf_dirs(tmp_path, tiny_hf):
    with pytest.raises(ValueError, match="does not exist"):
        shard.hf2mcore(tmp_path / "missing", tmp_path / "e")
    (tiny_hf / "model.safetensors").rename(tmp_path / "moved.safetensors")
    with pytest.raises(ValueError, match="holds no weights"):
        shard.hf2mcore(tiny_hf, tmp_path / "e")
    (tiny_hf / "model.safetensors").write_bytes((tmp_path / "moved.safetensors").read_bytes()[:1000])
    with pytest.raises(ValueError, match="truncated or corrupt"):
        shard.hf2mcore(tiny_hf, tmp_path / "e")
    raw = json.loads((tiny_hf / "config.json").read_text())
    (tiny_hf / "config.json").write_text(json.dumps({**raw, "model_type": "gpt2"}))
    with pytest.raises(ValueError, match="unknown architecture"):
        shard.hf2mcore(tiny_hf, tmp_path / "e")


def test_mixed_dtypes_need_an_explicit_dtype(tmp_path):
    cfg = tiny_config("llama")
    state = write_tiny_hf(tmp_path / "hf", cfg)
    state["model.norm.weight"] = state["model.norm.weight"].half()
    save_file(state, str(tmp_path / "hf" / "model.safetensors"))
    with pytest.raises(ValueError, match="mixes dtypes.*--dtype"):
        shard.hf2mcore(tmp_path / "hf", tmp_path / "e")
    assert shard.hf2mcore(tmp_path / "hf", tmp_path / "e", dtype=torch.bfloat16).dtype == "bfloat16"

"""export-megatron / import-megatron: Megatron-core torch_dist layout, bit-identical round trip, errors."""
from __future__ import annotations

import json

import pytest
import torch
from ckpt_helpers import ARCHS, assert_same_tensors, tiny_state
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import BytesStorageMetadata

from spd_engine.checkpoint_tools import hf, megatron_dcp
from spd_engine.engine.model.model_config import tiny_config


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_export_import_bit_identical(tmp_path, arch, dtype):
    cfg = tiny_config(arch)
    state = {k: v.to(dtype) for k, v in tiny_state(cfg).items()}
    megatron_dcp.export_megatron(tmp_path, cfg, state)
    cfg2, back = megatron_dcp.import_megatron(tmp_path)
    assert cfg2 == cfg
    assert_same_tensors(back, state)


def test_layout_matches_megatron_gpt_sharded_state_dict(tmp_path):
    """Keys, stacked shapes and per-layer chunks as GPTModel.sharded_state_dict() (local spec) makes them."""
    cfg = tiny_config("qwen3")  # tied, q/k norms
    L, H, hd = cfg.num_layers, cfg.hidden_size, cfg.head_dim
    megatron_dcp.export_megatron(tmp_path, cfg, tiny_state(cfg))
    assert json.loads((tmp_path / "metadata.json").read_text()) == megatron_dcp.METADATA_JSON
    common = torch.load(tmp_path / "common.pt", weights_only=True)
    assert common["checkpoint_version"] == 3.0
    meta = FileSystemReader(tmp_path).read_metadata().state_dict_metadata
    tensors = {k: tuple(v.size) for k, v in meta.items() if not isinstance(v, BytesStorageMetadata)}
    assert tensors == {
        "embedding.word_embeddings.weight": (cfg.vocab_size, H),
        "decoder.layers.self_attention.linear_qkv.layer_norm_weight": (L, H),
        "decoder.layers.self_attention.linear_qkv.weight": (L, cfg.qkv_rows, H),
        "decoder.layers.self_attention.q_layernorm.weight": (L, hd),
        "decoder.layers.self_attention.k_layernorm.weight": (L, hd),
        "decoder.layers.self_attention.linear_proj.weight": (L, H, cfg.num_heads * hd),
        "decoder.layers.mlp.linear_fc1.layer_norm_weight": (L, H),
        "decoder.layers.mlp.linear_fc1.weight": (L, 2 * cfg.intermediate_size, H),
        "decoder.layers.mlp.linear_fc2.weight": (L, H, cfg.intermediate_size),
        "decoder.final_layernorm.weight": (H,),
    }
    qkv = meta["decoder.layers.self_attention.linear_qkv.weight"]
    assert sorted(c.offsets[0] for c in qkv.chunks) == list(range(L)) and all(c.sizes[0] == 1 for c in qkv.chunks)
    objects = {k for k, v in meta.items() if isinstance(v, BytesStorageMetadata)}
    assert "decoder.layers.mlp.linear_fc1._extra_state/shard_3_6" in objects and len(objects) == 4 * L


def test_release_layout_and_tokenizer(tmp_path):
    cfg = tiny_config("llama")
    state = tiny_state(cfg)
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer.json").write_text("{}")
    out = megatron_dcp.export_megatron(tmp_path / "m", cfg, state, release_layout=True, tokenizer_src=tmp_path / "tok")
    assert out == tmp_path / "m" / "release"
    assert (tmp_path / "m" / megatron_dcp.TRACKER_FILE).read_text() == "release"
    assert megatron_dcp.tokenizer_dir(tmp_path / "m") is not None
    assert_same_tensors(megatron_dcp.import_megatron(tmp_path / "m")[1], state)


def test_vocab_padding_is_dropped(tmp_path):
    """Megatron-LM pads the vocabulary; the padding rows are not part of the model."""
    padded_cfg = tiny_config("qwen2", vocab_size=128)
    state = tiny_state(padded_cfg)
    megatron_dcp.export_megatron(tmp_path, padded_cfg, state)
    cfg = tiny_config("qwen2")  # vocab 96
    _, back = megatron_dcp.import_megatron(tmp_path, cfg)
    assert torch.equal(back["embedding.word_embeddings.weight"], state["embedding.word_embeddings.weight"][:96])


def test_import_errors(tmp_path):
    cfg = tiny_config("llama")
    with pytest.raises(ValueError, match="does not exist"):
        megatron_dcp.import_megatron(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="metadata.json is missing"):
        megatron_dcp.import_megatron(tmp_path / "empty")
    megatron_dcp.export_megatron(tmp_path / "m", cfg, tiny_state(cfg))
    with pytest.raises(ValueError, match="has shape .* the model config needs"):
        megatron_dcp.import_megatron(tmp_path / "m", tiny_config("llama", intermediate_size=64))
    with pytest.raises(ValueError, match="linear_qkv.bias is missing"):
        megatron_dcp.import_megatron(tmp_path / "m", tiny_config("llama", qkv_bias=True))
    torch.save({"checkpoint_version": 3.0}, tmp_path / "m" / "common.pt")
    with pytest.raises(ValueError, match="records no model config"):
        megatron_dcp.import_megatron(tmp_path / "m")
    (tmp_path / "m" / "metadata.json").write_text(json.dumps({"sharded_backend": "zarr"}))
    with pytest.raises(ValueError, match="'zarr' is not supported"):
        megatron_dcp.import_megatron(tmp_path / "m", cfg)


def test_export_rejects_a_state_of_another_model(tmp_path):
    cfg = tiny_config("llama")
    with pytest.raises(ValueError, match="does not match the qwen2 config"):
        megatron_dcp.export_megatron(tmp_path, tiny_config("qwen2"), tiny_state(cfg))


def test_import_with_an_hf_config(tmp_path):
    cfg = tiny_config("qwen2")
    state = tiny_state(cfg)
    megatron_dcp.export_megatron(tmp_path / "m", cfg, state)
    torch.save({}, tmp_path / "m" / "common.pt")  # as if Megatron itself had written it
    hf.write_hf_dir(tmp_path / "hf", cfg, {"x": torch.zeros(1)})
    cfg2, back = megatron_dcp.import_megatron(tmp_path / "m", hf.read_hf_config(tmp_path / "hf")[0])
    assert cfg2 == cfg
    assert_same_tensors(back, state)


@pytest.mark.parametrize("saved,read,named", [
    (dict(arch="qwen2"), dict(arch="qwen2", qkv_bias=False), "decoder.layers.self_attention.linear_qkv.bias"),
    (dict(arch="llama"), dict(arch="llama", tie_embeddings=True), "output_layer.weight"),
    (dict(arch="qwen3"), dict(arch="qwen3", qk_norm=False), "decoder.layers.self_attention.q_layernorm.weight"),
])
def test_unexplained_tensors_are_refused_by_name(tmp_path, saved, read, named):
    """A tensor the config does not explain (bias, untied head, q/k norm) is an error, not dropped."""
    cfg = tiny_config(**saved)
    megatron_dcp.export_megatron(tmp_path, cfg, tiny_state(cfg))
    with pytest.raises(ValueError, match=f"does not explain: .*{named}"):
        megatron_dcp.import_megatron(tmp_path, tiny_config(**read))


def test_optimizer_state_is_not_model(tmp_path):
    """Tensors under optimizer.* (a training checkpoint) and _extra_state are skipped; the rest is not."""
    import torch.distributed.checkpoint as dcp

    saved = {"optimizer.state.exp_avg.embedding.word_embeddings.weight": torch.ones(3),
             "decoder.layers.mlp.linear_fc1._extra_state": torch.ones(1), "output_layer.weight": torch.ones(2)}
    with pytest.warns(UserWarning, match="torch.distributed is disabled"):  # single-process DCP says so
        dcp.save(saved, storage_writer=dcp.FileSystemWriter(tmp_path), no_dist=True)
    meta = megatron_dcp.SafeReader(tmp_path).read_metadata()
    assert megatron_dcp.unexplained_tensors(meta, set()) == ["output_layer.weight"]
    assert megatron_dcp.unexplained_tensors(meta, {"output_layer.weight"}) == []

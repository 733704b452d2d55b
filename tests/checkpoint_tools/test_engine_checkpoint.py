"""The engine checkpoint format: any stage split loads from any checkpoint split; bad inputs fail clearly."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from ckpt_helpers import ARCHS, tiny_state
from safetensors.torch import load_file, save_file

from spd_engine.checkpoint_tools import key_maps, shard
from spd_engine.engine.model import checkpoint as ckpt
from spd_engine.engine.model.model import StageModel
from spd_engine.engine.model.model_config import ModelConfig, tiny_config
from spd_engine.engine.protocol.topology import stage_bounds

RUNTIME_SPLITS = ([6], [3, 3], [2, 2, 2], [1, 2, 3], [2, 1, 1, 2], [1] * 6)


def _expected_stage(state, cfg, layers, embedding, head):
    names = StageModel(cfg, layers, embedding=embedding, head=head, device="meta").state_dict()
    source = {n: ("embedding.word_embeddings.weight" if n == "output_layer.weight" and cfg.tie_embeddings else n)
              for n in names}
    return {n: state[s] for n, s in source.items()}


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("ckpt_pp", [1, 2, 4])
def test_any_stage_split_loads_from_any_checkpoint_split(tmp_path, arch, ckpt_pp):
    cfg = tiny_config(arch)
    state = tiny_state(cfg)
    shard.write_engine(tmp_path, cfg, state, pp=ckpt_pp)
    for split in RUNTIME_SPLITS:
        b = stage_bounds(split)
        for p in range(len(split)):
            layers = range(b[p], b[p + 1])
            got = ckpt.load_stage_state(tmp_path, layers, tp_rank=0, cfg=cfg)
            want = _expected_stage(state, cfg, layers, p == 0, p == len(split) - 1)
            assert sorted(got) == sorted(want), (split, p)
            assert all(torch.equal(got[k], want[k]) for k in want), (split, p)


def test_stage_of_own_split_and_driver_head_only(tmp_path):
    cfg = tiny_config("qwen2")  # tied embeddings
    state = tiny_state(cfg)
    index = shard.write_engine(tmp_path, cfg, state, stage_layers="1,3,2")
    assert index.stage_layers == (1, 3, 2)
    s1 = ckpt.load_stage_state(tmp_path, 1)
    assert {ckpt.layer_of(k) for k in s1} == {1, 2, 3}
    # A co-located driver holds only the final norm and the (tied) head.
    head = ckpt.load_stage_state(tmp_path, range(6, 6), embedding=False, head=True)
    assert sorted(head) == ["decoder.final_layernorm.weight", "output_layer.weight"]
    assert torch.equal(head["output_layer.weight"], state["embedding.word_embeddings.weight"])


def test_stages_compose_to_the_full_model(tmp_path):
    cfg = tiny_config("llama")
    state = tiny_state(cfg)
    shard.write_engine(tmp_path, cfg, state, pp=2)
    full = StageModel.full(cfg)
    full.load_state_dict(state)
    stages = [ckpt.load_stage_model(tmp_path, range(0, 4)), ckpt.load_stage_model(tmp_path, range(4, 6))]
    tokens = torch.randint(0, cfg.vocab_size, (1, 7))
    with torch.no_grad():
        want = full.logits(full.forward_layers(full.embed(tokens), full.new_cache(1, 7), 0)[0])
        h = stages[0].forward_layers(stages[0].embed(tokens), stages[0].new_cache(1, 7), 0)[0]
        got = stages[1].logits(stages[1].forward_layers(h, stages[1].new_cache(1, 7), 0)[0])
    assert torch.equal(got, want)


def test_rewriting_with_another_split_leaves_no_stale_shards(tmp_path):
    cfg = tiny_config("llama")
    shard.write_engine(tmp_path / "e", cfg, tiny_state(cfg), pp=4)
    with pytest.raises(ValueError, match="is not empty; .* --force"):
        shard.write_engine(tmp_path / "e", cfg, tiny_state(cfg), pp=2)
    assert len(list((tmp_path / "e").glob("*.safetensors"))) == 4  # refused: the old checkpoint is untouched
    index = shard.write_engine(tmp_path / "e", cfg, tiny_state(cfg), pp=2, force=True)
    assert sorted(p.name for p in (tmp_path / "e").glob("*.safetensors")) == sorted(s.file for s in index.shards)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["e"]  # no temporary or replaced copy left beside it


def test_tp_rank_files_hold_their_shards(tmp_path):
    cfg = tiny_config("qwen3")
    state = tiny_state(cfg)
    index = shard.write_engine(tmp_path, cfg, state, pp=2, tp=2)
    assert sorted(s.file for s in index.shards) == [ckpt.shard_file_name(p, 2, r, 2) for p in range(2) for r in range(2)]
    ranks = [ckpt.load_stage_state(tmp_path, range(0, 6), True, True, tp_rank=r) for r in range(2)]
    merged = key_maps.merge_state(ranks, cfg)
    assert all(torch.equal(merged[k], state[k]) for k in state)
    assert ranks[0]["decoder.layers.0.self_attention.linear_qkv.weight"].shape[0] == cfg.qkv_rows // 2


def test_index_records_config_split_and_hashes(tmp_path):
    cfg = tiny_config("llama")
    state = tiny_state(cfg)
    a = shard.write_engine(tmp_path / "a", cfg, state, pp=3)
    b = shard.write_engine(tmp_path / "b", cfg, state, stage_layers=[1, 1, 4])
    raw = json.loads((tmp_path / "a" / ckpt.INDEX_FILE).read_text())
    assert ModelConfig.from_dict(raw["model_config"]) == cfg
    assert raw["stage_layers"] == [2, 2, 2] and raw["tp"] == 1 and raw["dtype"] == "float32"
    assert a.content_hash == b.content_hash  # the hash covers tensors, not how they are split
    changed = dict(state, **{"decoder.final_layernorm.weight": state["decoder.final_layernorm.weight"] + 1})
    assert shard.write_engine(tmp_path / "c", cfg, changed, pp=3).content_hash != a.content_hash


# ---- bad inputs ----

@pytest.fixture
def written(tmp_path):
    cfg = tiny_config("llama")
    shard.write_engine(tmp_path, cfg, tiny_state(cfg), pp=2)
    return tmp_path, cfg


def test_missing_path_index_and_shard(tmp_path, written):
    path, _ = written
    with pytest.raises(ValueError, match="does not exist"):
        ckpt.load_stage_state(tmp_path / "nope", 0)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="index.json is missing"):
        ckpt.read_index(tmp_path / "empty")
    (path / ckpt.shard_file_name(1, 2, 0, 1)).unlink()
    ckpt.load_stage_state(path, 0)  # stage 0 does not need the missing file
    with pytest.raises(ValueError, match="shard file stage-01-of-02.tp-00-of-01.safetensors is missing"):
        ckpt.load_stage_state(path, 1)


def test_truncated_shard(written):
    path, _ = written
    file = path / ckpt.shard_file_name(0, 2, 0, 1)
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="truncated or corrupt"):
        ckpt.load_stage_state(path, 0)


def test_corrupt_shard_bytes(written):
    path, _ = written
    file = path / ckpt.shard_file_name(1, 2, 0, 1)
    data = bytearray(file.read_bytes())
    data[-3] ^= 0xFF  # flips bits inside the last tensor's data; the header stays valid
    file.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"is corrupt \(sha256"):
        ckpt.load_stage_state(path, 1)
    ckpt.load_stage_state(path, 1, verify=False)  # only the hash check can see this


def test_tensor_with_wrong_shape(written):
    path, _ = written
    file = path / ckpt.shard_file_name(0, 2, 0, 1)
    tensors = load_file(str(file))
    tensors["decoder.layers.1.mlp.linear_fc2.weight"] = tensors["decoder.layers.1.mlp.linear_fc2.weight"][:, :-1].clone()
    save_file(tensors, str(file))
    with pytest.raises(ValueError, match="linear_fc2.weight has shape"):
        ckpt.load_stage_state(path, 0)


def _edit_index(path: Path, edit) -> None:
    raw = json.loads((path / ckpt.INDEX_FILE).read_text())
    edit(raw)
    (path / ckpt.INDEX_FILE).write_text(json.dumps(raw))


def test_config_mismatch(written):
    path, cfg = written
    with pytest.raises(ValueError, match="different model config.*hidden_size"):
        ckpt.load_stage_state(path, 0, cfg=tiny_config("llama", hidden_size=32))
    # An index whose config was edited by hand is caught by the content hash, whether the edit changes
    # a shape (intermediate_size) or only how the model runs (rope_theta, the end-of-text ids).
    good = (path / ckpt.INDEX_FILE).read_text()
    for edit in ({"intermediate_size": 64}, {"rope_theta": 1.0}, {"eos_token_ids": [5]}):
        _edit_index(path, lambda raw: raw["model_config"].update(edit))
        with pytest.raises(ValueError, match="content hash does not match the config"):
            ckpt.load_stage_state(path, 0)
        (path / ckpt.INDEX_FILE).write_text(good)
    ckpt.load_stage_state(path, 0)  # the unedited index still reads
    _edit_index(path, lambda raw: raw.update(dtype="bfloat16"))
    with pytest.raises(ValueError, match="content hash"):
        ckpt.read_index(path)


def test_unknown_architecture_and_malformed_index(written):
    path, _ = written
    _edit_index(path, lambda raw: raw["model_config"].update(arch="gpt2"))
    with pytest.raises(ValueError, match="unknown architecture 'gpt2'"):
        ckpt.read_index(path)
    (path / ckpt.INDEX_FILE).write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        ckpt.read_index(path)


def test_edited_tensor_list_breaks_the_content_hash(written):
    path, _ = written
    _edit_index(path, lambda raw: raw["shards"][0]["tensors"]["decoder.layers.0.input_layernorm.weight"]
                .update(sha256="0" * 64))
    with pytest.raises(ValueError, match="content hash"):
        ckpt.read_index(path)


def test_stage_and_rank_out_of_range(written):
    path, _ = written
    with pytest.raises(ValueError, match="stage 2 does not exist"):
        ckpt.load_stage_state(path, 2)
    with pytest.raises(ValueError, match="tp rank 1 does not exist"):
        ckpt.load_stage_state(path, 0, tp_rank=1)
    with pytest.raises(ValueError, match="outside the model's 6 layers"):
        ckpt.load_stage_state(path, range(4, 8))

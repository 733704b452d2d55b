"""Linear biases on every layer (Megatron's add_bias_linear, HF llama's attention_bias + mlp_bias):
config, HF conversion against transformers, Megatron round trip, and tensor-parallel shards."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from ckpt_helpers import assert_same_tensors, tiny_state, write_tiny_hf

from spd_engine.checkpoint_tools import megatron_dcp, shard
from spd_engine.engine.model.model import StageModel
from spd_engine.engine.model.model_config import ModelConfig, tiny_config
from spd_engine.engine.model.tp_model import SerialTP, TPStageModel
from spd_engine.engine.model.tp_shard import merge_tensor, reshard_piece, shard_state, shard_tensor

BIASED = tiny_config("llama", qkv_bias=True, linear_bias=True)
BIASES = ("self_attention.linear_proj.bias", "mlp.linear_fc1.bias", "mlp.linear_fc2.bias")


def test_config_field_and_its_old_fingerprint():
    assert all(f"decoder.layers.0.{b}" in tiny_state(BIASED) for b in BIASES)
    with pytest.raises(ValueError, match="needs qkv_bias"):
        tiny_config("llama", linear_bias=True)
    plain = tiny_config("llama")
    assert "linear_bias" not in plain.to_dict()  # configs written before the field hash as they did
    assert ModelConfig.from_dict(BIASED.to_dict()) == BIASED
    hf_cfg = BIASED.to_hf()
    assert hf_cfg["attention_bias"] is True and hf_cfg["mlp_bias"] is True
    assert ModelConfig.from_hf(hf_cfg) == BIASED
    with pytest.raises(ValueError, match="mlp_bias"):
        ModelConfig.from_hf({**hf_cfg, "mlp_bias": False})


def test_hf_conversion_matches_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    write_tiny_hf(tmp_path / "hf", BIASED)
    shard.hf2mcore(tmp_path / "hf", tmp_path / "e", pp=2, tp=2)
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    assert ref.model.layers[0].mlp.down_proj.bias is not None and ref.model.layers[0].self_attn.o_proj.bias is not None
    cfg, state = shard.read_engine(tmp_path / "e")
    model = StageModel.full(cfg)
    model.load_state_dict(state)
    tokens = torch.randint(0, cfg.vocab_size, (1, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = ref(tokens).logits
        got = model.logits(model.forward_layers(model.embed(tokens), model.new_cache(1, 9), 0)[0])
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        for name in [n for n in state if n.endswith(BIASES[2])]:  # control: the biases matter
            state[name] = torch.zeros_like(state[name])
        model.load_state_dict(state)
        dropped = model.logits(model.forward_layers(model.embed(tokens), model.new_cache(1, 9), 0)[0])
    assert (dropped - want).abs().max() > 1e-3


def test_megatron_round_trip_is_bit_identical(tmp_path):
    state = tiny_state(BIASED)
    megatron_dcp.export_megatron(tmp_path, BIASED, state)
    cfg, back = megatron_dcp.import_megatron(tmp_path)
    assert cfg == BIASED
    assert_same_tensors(back, state)
    with pytest.raises(ValueError, match="does not explain: .*linear_fc2.bias"):  # and refused without the field
        megatron_dcp.import_megatron(tmp_path, dataclasses.replace(BIASED, linear_bias=False))


@pytest.mark.parametrize("src,dst", [(1, 2), (2, 1), (2, 4), (4, 2), (1, 4), (4, 1)])
def test_biases_reshard_between_any_tp_splits(src, dst):
    cfg = tiny_config("llama", qkv_bias=True, linear_bias=True, num_heads=4, num_kv_heads=4)
    for suffix, size in zip(BIASES, (cfg.hidden_size, 2 * cfg.intermediate_size, cfg.hidden_size)):
        name, full = f"decoder.layers.0.{suffix}", torch.randn(size)
        stored = shard_tensor(name, full, cfg, src)
        got = [reshard_piece(name, lambda r: stored[r], cfg, src, dst, r) for r in range(dst)]
        assert all(torch.equal(g, w) for g, w in zip(got, shard_tensor(name, full, cfg, dst))), name
        assert torch.equal(merge_tensor(name, got), full)
        if "fc1" not in suffix:  # row-parallel: the ranks' pieces add up to the bias, once
            assert torch.equal(sum(got), full), name
    with pytest.raises(ValueError, match="non-zero beyond TP rank 0"):
        merge_tensor(f"decoder.layers.0.{BIASES[0]}", [torch.ones(3), torch.ones(3)])


def test_tensor_parallel_shards_add_each_bias_once():
    """The row-parallel biases are added once to the reduced sum, so TP=2 equals the unsharded model."""
    cfg = BIASED
    state = tiny_state(cfg)
    full = StageModel.full(cfg)
    full.load_state_dict(state)
    ranks = shard_state(state, cfg, 2)

    def make(group):
        m = TPStageModel(cfg, range(cfg.num_layers), group, embedding=True, head=True)
        m.load_state_dict(ranks[group.rank])
        return m

    serial = SerialTP.build(make, 2)
    ids = torch.tensor([[1, 5, 7, 9, 11, 3, 8]])
    with torch.no_grad():
        h, _ = full.forward_layers(full.embed(ids), full.new_cache(1, 16), 0)
        h_tp, _ = serial.forward_layers(serial.embed(ids), serial.new_cache(1, 16), 0)
        want, got = full.logits(h), serial.logits(h_tp)
    assert (want - got).abs().max() <= 1e-5 * want.abs().max()

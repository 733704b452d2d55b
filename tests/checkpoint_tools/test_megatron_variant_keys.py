"""Tensor names of Megatron-LM's GPT variants: the key maps cover every tensor the model has (LayerNorm
biases, a one-projection GeLU fc1), torch_dist names the layer norms' biases as Megatron's local spec
does, an export imports bit for bit, and a LayerNorm checkpoint read under an RMSNorm config is refused
naming its biases (no megatron-core needed)."""
from __future__ import annotations

import dataclasses

import pytest
from ckpt_helpers import assert_same_tensors, tiny_state

from spd_engine.checkpoint_tools import key_maps, megatron_dcp
from spd_engine.engine.model.model_config import tiny_config

CFG = tiny_config("llama", num_layers=2, rope_scaling=None, norm="layernorm", norm_1p=True, qk_norm=True,
                  rotary_percent=0.5, activation="gelu_tanh", qkv_bias=True, linear_bias=True)


def test_key_maps_cover_every_tensor_of_a_variant_model():
    state = tiny_state(CFG)
    assert sorted(key_maps.mcore_keys(CFG)) == sorted(state)
    assert state["decoder.layers.0.mlp.linear_fc1.weight"].shape == (CFG.intermediate_size, CFG.hidden_size)
    assert_same_tensors(key_maps.hf_to_mcore(key_maps.mcore_to_hf(state, CFG), CFG), state)
    assert key_maps.to_dist_key("decoder.layers.1.input_layernorm.bias") == (
        "decoder.layers.self_attention.linear_qkv.layer_norm_bias", 1)
    assert key_maps.to_dist_key("decoder.layers.0.pre_mlp_layernorm.bias") == (
        "decoder.layers.mlp.linear_fc1.layer_norm_bias", 0)
    assert key_maps.from_dist_key("decoder.layers.mlp.linear_fc1.layer_norm_bias", 1) == \
        "decoder.layers.1.pre_mlp_layernorm.bias"


def test_export_imports_bit_for_bit_and_a_wrong_norm_is_refused_by_name(tmp_path):
    state = tiny_state(CFG, seed=2)
    megatron_dcp.export_megatron(tmp_path / "m", CFG, state)
    cfg, got = megatron_dcp.import_megatron(tmp_path / "m")
    assert cfg == CFG
    assert_same_tensors(got, state)
    rms = dataclasses.replace(CFG, norm="rmsnorm")
    with pytest.raises(ValueError, match="does not explain: .*layer_norm_bias"):
        megatron_dcp.import_megatron(tmp_path / "m", rms)
    swiglu = dataclasses.replace(CFG, activation="swiglu")  # a gated fc1 would be [2 I, H]
    with pytest.raises(ValueError, match=r"linear_fc1.weight has shape \(2, 128, 64\)"):
        megatron_dcp.import_megatron(tmp_path / "m", swiglu)

"""`verify`: logits of two checkpoints of any kind agree, and a changed weight is caught."""
from __future__ import annotations

import pytest
import torch

from spd_engine.checkpoint_tools import megatron_dcp, shard, verify
from spd_engine.engine.model_config import tiny_config
from ckpt_helpers import tiny_state, write_tiny_hf


@pytest.fixture
def three_kinds(tmp_path):
    cfg = tiny_config("qwen2")
    write_tiny_hf(tmp_path / "hf", cfg)
    shard.hf2mcore(tmp_path / "hf", tmp_path / "engine", pp=3, tp=2)
    megatron_dcp.export_megatron(tmp_path / "megatron", cfg, tiny_state(cfg))
    return tmp_path, cfg


def test_detect_kind(three_kinds):
    path, _ = three_kinds
    assert [verify.detect_kind(path / k) for k in ("hf", "engine", "megatron")] == ["hf", "engine", "megatron"]
    with pytest.raises(ValueError, match="neither an engine checkpoint"):
        verify.detect_kind(path)
    with pytest.raises(ValueError, match="does not exist"):
        verify.detect_kind(path / "missing")


def test_same_weights_agree_across_kinds(three_kinds):
    path, _ = three_kinds
    for a, b in (("hf", "engine"), ("engine", "megatron"), ("megatron", "hf")):
        result = verify.verify(path / a, path / b, atol=0.0)
        assert result.passed and result.max_abs_diff == 0.0 and result.argmax_agreement == 1.0
        assert result.positions == 3 * 16


def test_a_changed_weight_fails(three_kinds, tmp_path):
    path, cfg = three_kinds
    state = tiny_state(cfg)
    state["decoder.layers.2.mlp.linear_fc2.weight"] = state["decoder.layers.2.mlp.linear_fc2.weight"] * 1.5
    megatron_dcp.export_megatron(tmp_path / "changed", cfg, state)
    result = verify.verify(path / "hf", tmp_path / "changed", atol=1e-4)
    assert not result.passed and result.max_abs_diff > 1e-4
    assert "FAIL" in result.summary()


def test_bf16_copy_is_close_but_not_exact(three_kinds, tmp_path):
    path, _ = three_kinds
    shard.hf2mcore(path / "hf", tmp_path / "bf16", dtype=torch.bfloat16)
    assert not verify.verify(path / "hf", tmp_path / "bf16", atol=0.0).passed
    assert verify.verify(path / "hf", tmp_path / "bf16", atol=0.05, min_agreement=0.9).passed


def test_different_models_are_an_error(three_kinds, tmp_path):
    path, _ = three_kinds
    write_tiny_hf(tmp_path / "other", tiny_config("qwen2", num_layers=4))
    with pytest.raises(ValueError, match="different models"):
        verify.verify(path / "hf", tmp_path / "other")

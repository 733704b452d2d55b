"""`verify`: logits of two checkpoints of any kind agree, and a changed weight is caught."""
from __future__ import annotations

import pytest
import torch
from ckpt_helpers import tiny_state, write_tiny_hf
from near_ties import count_near_ties

from spd_engine.checkpoint_tools import megatron_dcp, shard
from spd_engine.checkpoint_tools import verify_checkpoint as verify
from spd_engine.engine.model.model_config import tiny_config


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


SAME_BOUND = 1e-6  # tiny logits O(1); measured 0 on an AVX-512 Intel host


def test_same_weights_agree_across_kinds(three_kinds):
    """The three kinds hold bit-identical weights; each loader leaves them at its own addresses,
    which may pick another BLAS kernel (docs/testing.md), so the logits are held to a bound, and
    the argmax may differ only at near-ties of these prompts (there are none)."""
    path, cfg = three_kinds
    states = {k: verify.load_any(path / k)[1] for k in ("hf", "engine", "megatron")}
    assert all(sorted(states[k]) == sorted(states["hf"]) for k in states)
    assert all(torch.equal(states[k][name], t) for k in states for name, t in states["hf"].items())
    model = verify.build_model(cfg, states["hf"])
    logits = torch.cat([verify.prompt_logits(model, p) for p in verify.default_prompts(cfg)])
    ties = count_near_ties(logits, SAME_BOUND)
    for a, b in (("hf", "engine"), ("engine", "megatron"), ("megatron", "hf")):
        result = verify.verify(path / a, path / b, atol=SAME_BOUND, min_agreement=1 - ties / len(logits),
                               reference="engine")
        assert result.passed and result.max_abs_diff <= SAME_BOUND, result.summary()
        assert result.positions == 3 * 16


def test_a_changed_weight_fails(three_kinds, tmp_path):
    path, cfg = three_kinds
    state = tiny_state(cfg)
    state["decoder.layers.2.mlp.linear_fc2.weight"] = state["decoder.layers.2.mlp.linear_fc2.weight"] * 1.5
    megatron_dcp.export_megatron(tmp_path / "changed", cfg, state)
    result = verify.verify(path / "hf", tmp_path / "changed", atol=1e-4, reference="engine")
    assert not result.passed and result.max_abs_diff > 1e-4
    assert "FAIL" in result.summary()


def test_bf16_copy_is_close_but_not_exact(three_kinds, tmp_path):
    path, _ = three_kinds
    shard.hf2mcore(path / "hf", tmp_path / "bf16", dtype=torch.bfloat16)
    assert not verify.verify(path / "hf", tmp_path / "bf16", atol=0.0, reference="engine").passed
    assert verify.verify(path / "hf", tmp_path / "bf16", atol=0.05, min_agreement=0.9, reference="engine").passed


def test_different_models_are_an_error(three_kinds, tmp_path):
    path, _ = three_kinds
    write_tiny_hf(tmp_path / "other", tiny_config("qwen2", num_layers=4))
    with pytest.raises(ValueError, match="different models"):
        verify.verify(path / "hf", tmp_path / "other", reference="engine")


def test_an_hf_side_runs_in_transformers(three_kinds, tmp_path):
    """The independent reference: the HF directory in transformers, not through the engine's key maps."""
    pytest.importorskip("transformers")
    path, cfg = three_kinds
    result = verify.verify(path / "hf", path / "engine", atol=1e-4)
    assert result.passed and result.sources == ("transformers", "engine"), result.summary()
    assert "A by transformers, B by engine" in result.summary()
    state = tiny_state(cfg)  # a wrong weight in the engine side is caught against transformers
    state["decoder.layers.1.self_attention.linear_qkv.bias"] = state["decoder.layers.1.self_attention.linear_qkv.bias"] + 0.5
    shard.write_engine(tmp_path / "wrong", cfg, state)
    wrong = verify.verify(path / "hf", tmp_path / "wrong", atol=1e-4)
    assert not wrong.passed and wrong.sources == ("transformers", "engine")


@pytest.mark.slow
def test_our_megatron_export_runs_in_megatron_core(three_kinds):
    """HF in transformers against our Megatron export in megatron-core: no engine code on either side."""
    pytest.importorskip("transformers")
    pytest.importorskip("megatron.core", reason="megatron-core is a test extra")
    path, _ = three_kinds
    result = verify.verify(path / "hf", path / "megatron", atol=1e-4, prompt_count=1)
    assert result.passed and result.sources == ("transformers", "megatron-core"), result.summary()

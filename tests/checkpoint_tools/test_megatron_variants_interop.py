"""Interop of Megatron-LM's GPT variants: megatron-core's own GPTModel (local spec, CPU, gloo) loads our
torch_dist export of a LayerNorm / apply_layernorm_1p / GeLU / qk-layernorm / partial-RoPE model and
computes our logits (the worker: megatron_worker.py; megatron-core is a test extra)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from ckpt_helpers import tiny_state

from spd_engine.checkpoint_tools import megatron_dcp
from spd_engine.engine.model.model import StageModel
from spd_engine.engine.model.model_config import tiny_config

pytest.importorskip("megatron.core", reason="megatron-core is a test extra")
pytestmark = [pytest.mark.multiproc, pytest.mark.slow]

WORKER = Path(__file__).with_name("megatron_worker.py")
ROOT = Path(__file__).resolve().parents[2]
CASES = {
    "layernorm_gelu": tiny_config("llama", rope_scaling=None, norm="layernorm", activation="gelu"),
    "all_variants": tiny_config("llama", rope_scaling=None, norm="layernorm", norm_1p=True, qk_norm=True,
                                rotary_percent=0.5, activation="gelu_tanh", qkv_bias=True, linear_bias=True),
    "rmsnorm_1p_partial": tiny_config("llama", rope_scaling=None, norm_1p=True, rotary_percent=0.5),
}


def _our_logits(cfg, state, tokens):
    model = StageModel.full(cfg)
    model.load_state_dict(state)
    with torch.no_grad():
        return model.logits(model.forward_layers(model.embed(tokens), model.new_cache(*tokens.shape), 0)[0])


def test_megatron_gpt_model_loads_our_export_of_each_variant(tmp_path):
    tokens = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(1))
    (tmp_path / "tokens.json").write_text(json.dumps(tokens.tolist()))
    states, args = {name: tiny_state(cfg) for name, cfg in CASES.items()}, []
    for name, cfg in CASES.items():
        megatron_dcp.export_megatron(tmp_path / name, cfg, states[name])
        args += [str(tmp_path / name), str(tmp_path / f"{name}.pt")]
    run = subprocess.run([sys.executable, str(WORKER), str(tmp_path / "tokens.json"), *args],
                         capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert run.returncode == 0, run.stderr[-4000:]
    for name, cfg in CASES.items():
        theirs = torch.load(tmp_path / f"{name}.pt")
        if cfg.norm == "layernorm":  # the norm biases went where megatron-core reads them
            assert "decoder.layers.0.input_layernorm.bias" in theirs["loaded_keys"], name
        ours = _our_logits(cfg, states[name], tokens)
        torch.testing.assert_close(theirs["logits"], ours, rtol=1e-4, atol=1e-5, msg=name)
        assert torch.equal(theirs["logits"].argmax(-1), ours.argmax(-1)), name

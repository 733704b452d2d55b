"""Interop: Megatron-core's own GPTModel (local spec, CPU, gloo) loads our torch_dist export.

Needs the test extra `megatron-core` (`pip install --no-deps megatron-core==0.16.1`; its remaining
requirements torch, numpy and packaging are already installed). The work runs in a subprocess
(`megatron_worker.py`), which owns the process group and the CUDA shims.
"""
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

pytest.importorskip("megatron.core", reason="megatron-core is a test extra: pip install --no-deps megatron-core==0.16.1")
pytestmark = pytest.mark.multiproc

WORKER = Path(__file__).with_name("megatron_worker.py")
ROOT = Path(__file__).resolve().parents[2]
# Megatron hard-codes llama3 RoPE scaling's low/high factors and original context of 8192.
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}


def _our_logits(cfg, state, tokens):
    model = StageModel.full(cfg)
    model.load_state_dict(state)
    with torch.no_grad():
        h, _ = model.forward_layers(model.embed(tokens), model.new_cache(*tokens.shape), 0)
        return model.logits(h)  # [B, T, V]


def test_megatron_gpt_model_loads_our_export(tmp_path):
    cases = {
        "llama": tiny_config("llama", rope_scaling=LLAMA3_ROPE),
        "qwen2": tiny_config("qwen2"),
        "qwen3": tiny_config("qwen3"),
        # Megatron-LM's default add_bias_linear: biases on qkv, proj, fc1, fc2
        "biased": tiny_config("llama", rope_scaling=LLAMA3_ROPE, qkv_bias=True, linear_bias=True),
    }
    states = {name: tiny_state(cfg) for name, cfg in cases.items()}
    # Negative control: gate and up exchanged in every fc1 must NOT reproduce our logits.
    swapped = dict(states["llama"])
    for k in [k for k in swapped if k.endswith("linear_fc1.weight")]:
        gate, up = swapped[k].chunk(2)
        swapped[k] = torch.cat([up, gate])
    tokens = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(1))
    (tmp_path / "tokens.json").write_text(json.dumps(tokens.tolist()))
    args = []
    for name, state in [*states.items(), ("swapped", swapped)]:
        cfg = cases.get(name, cases["llama"])
        megatron_dcp.export_megatron(tmp_path / name, cfg, state)
        args += [str(tmp_path / name), str(tmp_path / f"{name}.pt")]
    run = subprocess.run([sys.executable, str(WORKER), str(tmp_path / "tokens.json"), *args],
                         capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert run.returncode == 0, run.stderr[-4000:]
    for name, cfg in cases.items():
        theirs = torch.load(tmp_path / f"{name}.pt")["logits"]
        ours = _our_logits(cfg, states[name], tokens)
        torch.testing.assert_close(theirs, ours, rtol=1e-4, atol=1e-5, msg=name)
        assert torch.equal(theirs.argmax(-1), ours.argmax(-1)), name
    control = torch.load(tmp_path / "swapped.pt")["logits"]
    assert (control - _our_logits(cases["llama"], states["llama"], tokens)).abs().max() > 1e-3

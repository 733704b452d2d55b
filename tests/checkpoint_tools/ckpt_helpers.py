"""Helpers shared by the checkpoint tests: tiny random models written as HF directories."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from spd_engine.checkpoint_tools import hf, key_maps
from spd_engine.engine.model.model import StageModel, init_random_
from spd_engine.engine.model.model_config import ModelConfig

ARCHS = ("llama", "qwen2", "qwen3")


def tiny_state(cfg: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random engine state dict (Megatron names) of the full model."""
    return dict(init_random_(StageModel.full(cfg), seed=seed).state_dict())


def write_tiny_hf(path: Path, cfg: ModelConfig, seed: int = 0, dtype: torch.dtype = torch.float32,
                  **kw) -> dict[str, torch.Tensor]:
    """An HF directory with random weights and a stand-in tokenizer file; returns its HF state dict."""
    state = {k: v.to(dtype) for k, v in key_maps.mcore_to_hf(tiny_state(cfg, seed), cfg).items()}
    hf.write_hf_dir(path, cfg, state, **kw)
    (path / "tokenizer_config.json").write_text(json.dumps({"model_max_length": cfg.max_position}))
    return state


def assert_same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    """Same names, dtypes, shapes and bits."""
    assert sorted(a) == sorted(b), sorted(set(a) ^ set(b))
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(a[k].contiguous().view(torch.uint8), b[k].contiguous().view(torch.uint8)), k

"""An HF directory whose config does not describe its weights (a wrong head_dim, intermediate_size,
...): one line naming the tensor, its shape and the config's, exit 2; never a reshape traceback."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from ckpt_helpers import tiny_state, write_tiny_hf

from spd_engine.checkpoint_tools import key_maps
from spd_engine.engine.model.model_config import ModelConfig, tiny_config
from spd_engine.tools.cli import main


def edited(tmp_path: Path, **fields) -> Path:
    """A tiny HF directory with `fields` changed in its config.json (the weights left as written)."""
    hf = tmp_path / "hf"
    write_tiny_hf(hf, tiny_config("llama"))
    (hf / "tokenizer.json").write_text('{"stand-in": true}')
    config = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**config, **fields}))
    return hf


def one_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    lines = err.splitlines()
    assert "Traceback" not in err and [ln for ln in lines if "error" in ln] == lines[-1:], err
    return lines[-1]


@pytest.mark.parametrize("fields, tensor", [
    (dict(head_dim=8), "q_proj.weight"),  # 4 heads of 8 where the weights have 4 of 16
    (dict(head_dim=32), "q_proj.weight"),
    (dict(intermediate_size=64), "gate_proj.weight"),
])
def test_hf2engine_names_the_tensor_the_config_does_not_describe(tmp_path: Path, capsys, fields, tensor) -> None:
    hf = edited(tmp_path, **fields)
    assert main(["convert", "hf2engine", str(hf), str(tmp_path / "e")]) == 2
    err = one_line(capsys)
    assert tensor in err and "the config does not describe these weights" in err, err
    if "head_dim" in fields:
        assert f"head_dim {fields['head_dim']}" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # nothing written


def test_generate_on_such_a_directory_is_one_line(tmp_path: Path, monkeypatch, capsys) -> None:
    """The same through `spd generate`, which converts an HF directory into its cache first."""
    monkeypatch.setenv("SPD_CACHE", str(tmp_path / "cache"))
    hf = edited(tmp_path, head_dim=8)
    assert main(["generate", "--model", str(hf), "--mode", "ar", "--prompt", "hi", "--max-new-tokens", "2"]) == 2
    assert "head_dim 8" in one_line(capsys)


@pytest.mark.pure
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_expected_hf_shapes_are_those_of_a_real_state(arch: str) -> None:
    cfg: ModelConfig = tiny_config(arch)
    state = key_maps.mcore_to_hf(tiny_state(cfg), cfg)
    assert key_maps.expected_hf_shapes(cfg) == {k: tuple(v.shape) for k, v in state.items()}

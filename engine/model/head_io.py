"""The checkpoint directory of a draft head (a PDM, engine/model/pdm.py, or an EAGLE head,
engine/model/eagle_head.py): `<stem>.safetensors` (as trained, cast, or int8 rows with scales,
engine/model/pdm_quant.py) + `<stem>.json` (`{"format": ..., "config": ..., **extra}`).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file
from torch import nn

from spd_engine.engine.model.model_config import ModelConfig
from spd_engine.engine.model.pdm_quant import dequantize_state, quantize_state


@dataclass(frozen=True)
class HeadFormat:
    """One kind of head directory: its file names, format tag and the names its errors use."""
    stem: str  # <stem>.safetensors + <stem>.json
    tag: str  # the JSON's "format"
    name: str  # in errors about its files ("corrupt <name> weights ...")
    head_name: str  # in errors about the model it was trained for
    dir_name: str  # in the error for a directory without the JSON ("no <dir_name> at ...")

    def meta_path(self, path: str | Path) -> Path:
        return Path(path) / f"{self.stem}.json"

    def weights_path(self, path: str | Path) -> Path:
        return Path(path) / f"{self.stem}.safetensors"


def save_head(head: nn.Module, out_dir: str | Path, fmt: HeadFormat, config: dict, extra: dict | None = None,
              dtype: torch.dtype | None = None) -> Path:
    """Write the head's weights (optionally cast; torch.int8: int8 rows with fp16 scales) + its JSON."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if dtype == torch.int8:
        state = quantize_state(head.state_dict())
    else:
        state = {k: v.detach().to(dtype or v.dtype).contiguous().cpu() for k, v in head.state_dict().items()}
    save_file(state, str(fmt.weights_path(out)))
    meta = {"format": fmt.tag, "config": config, **(extra or {})}
    fmt.meta_path(out).write_text(json.dumps(meta, indent=1))
    return out


def read_head_meta(path: str | Path, fmt: HeadFormat) -> dict:
    """The head's JSON, checked to be of `fmt` (no tensor data is read)."""
    meta_path = fmt.meta_path(path)
    if not meta_path.is_file():
        raise ValueError(f"no {fmt.dir_name} at {path}: {meta_path} is missing")
    try:
        meta = json.loads(meta_path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"corrupt {fmt.name} config {meta_path}: {err}") from None
    if meta.get("format") != fmt.tag:
        raise ValueError(f"{meta_path}: unknown {fmt.name} format {meta.get('format')!r}, expected {fmt.tag!r}")
    return meta


def check_fingerprint(fingerprint: str, target: ModelConfig, fmt: HeadFormat) -> None:
    """A clear error for a head trained for another model (an empty fingerprint: not recorded)."""
    if fingerprint and fingerprint != target.fingerprint():
        raise ValueError(f"{fmt.head_name} was trained for another model (target fingerprint "
                         f"{fingerprint}, this model is {target.fingerprint()})")


def read_head_state(path: str | Path, fmt: HeadFormat, dtype: torch.dtype) -> tuple[dict[str, torch.Tensor], Path]:
    """The stored tensors as `dtype` (int8 rows dequantized), and the file they came from (the
    weights file, or its zlib form: engine/model/head_zlib.py)."""
    from spd_engine.engine.model.head_zlib import compressed_path, load_weights, weights_exist

    wpath = fmt.weights_path(path)
    if not weights_exist(wpath):
        raise ValueError(f"{fmt.name} weights missing: {wpath}")
    if not wpath.is_file():
        wpath = compressed_path(wpath)
    try:
        state = dequantize_state(load_weights(fmt.weights_path(path)), dtype)
    except (SafetensorError, OSError) as err:
        raise ValueError(f"corrupt {fmt.name} weights {wpath}: {err}") from None
    return state, wpath

"""Read and write HF model directories: `config.json`, safetensors weights, tokenizer files.

Weights are one `model.safetensors` or several shards listed in `model.safetensors.index.json`
(HF's `weight_map`). The config goes through `ModelConfig.from_hf` / `to_hf`; when the source
`config.json` is at hand its extra fields (chat defaults, pad token, ...) are kept on write.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from spd_engine.engine.model.checkpoint import dtype_name, save_safetensors
from spd_engine.engine.model.model_config import ModelConfig

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Everything a tokenizer / chat template may need; copied along verbatim when present.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja",
                   "chat_template.json", "generation_config.json")
DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3


def is_hf_dir(path: str | Path) -> bool:
    p = Path(path)
    return (p / CONFIG_FILE).is_file() and ((p / SINGLE_FILE).is_file() or (p / INDEX_FILE).is_file())


def read_hf_config(path: str | Path) -> tuple[ModelConfig, dict]:
    """(ModelConfig, raw config.json dict) of an HF directory."""
    p = Path(path)
    if not p.is_dir():
        raise ValueError(f"HF model directory {p} does not exist")
    if not (p / CONFIG_FILE).is_file():
        raise ValueError(f"{p} is not an HF model directory: {CONFIG_FILE} is missing")
    try:
        raw = json.loads((p / CONFIG_FILE).read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{p / CONFIG_FILE} is not valid JSON: {err}") from None
    try:
        return ModelConfig.from_hf(raw), raw
    except KeyError as err:
        raise ValueError(f"{p / CONFIG_FILE} lacks the field {err}") from None


def weight_files(path: str | Path) -> list[Path]:
    p = Path(path)
    if (p / INDEX_FILE).is_file():
        weight_map = json.loads((p / INDEX_FILE).read_text()).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{p / INDEX_FILE} has no weight_map")
        files = [p / f for f in sorted(set(weight_map.values()))]
    elif (p / SINGLE_FILE).is_file():
        files = [p / SINGLE_FILE]
    else:
        raise ValueError(f"{p} holds no weights: neither {SINGLE_FILE} nor {INDEX_FILE}")
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise ValueError(f"HF weight shards are missing: {missing}")
    return files


def read_hf_state(path: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of an HF directory, HF names."""
    state: dict[str, torch.Tensor] = {}
    for file in weight_files(path):
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    if name in state:
                        raise ValueError(f"tensor {name} appears in two weight shards")
                    state[name] = f.get_tensor(name)
        except SafetensorError as err:
            raise ValueError(f"{file} is truncated or corrupt: {err}") from None
    return state


def copy_tokenizer_files(src: str | Path, dst: str | Path) -> list[str]:
    """Copy the tokenizer / generation files present in `src`; returns their names."""
    copied = []
    for name in TOKENIZER_FILES:
        if (Path(src) / name).is_file():
            shutil.copyfile(Path(src) / name, Path(dst) / name)
            copied.append(name)
    return copied


def hf_config_dict(cfg: ModelConfig, dtype: torch.dtype, base: dict | None = None) -> dict:
    """config.json contents: `base` (the source config) updated with what `cfg` defines."""
    if base is not None and ModelConfig.from_hf(base) != cfg:
        base = None  # the source config describes another model; do not mix it in
    out = dict(base or {})
    # keep the source's RoPE form: a transformers 5 config stays one, a 4.x config stays readable by 4.x
    form = "parameters" if out.get("rope_parameters") else "legacy"
    for key in ("rope_theta", "rope_scaling") if form == "parameters" else ("rope_parameters",):
        out.pop(key, None)
    out.update(cfg.to_hf(form))
    out["torch_dtype"] = dtype_name(dtype)
    if "dtype" in out:  # newer transformers name the field `dtype`
        out["dtype"] = dtype_name(dtype)
    return out


def _parse_shards(state: dict[str, torch.Tensor], max_bytes: int) -> list[list[str]]:
    """Greedy split of tensor names into files of at most `max_bytes` (a bigger tensor gets its own)."""
    groups: list[list[str]] = [[]]
    size = 0
    for name, t in state.items():
        nbytes = t.numel() * t.element_size()
        if groups[-1] and size + nbytes > max_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    return groups


def write_hf_dir(path: str | Path, cfg: ModelConfig, state: dict[str, torch.Tensor], *,
                 base_config: dict | None = None, tokenizer_src: str | Path | None = None,
                 max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> Path:
    """Write an HF directory loadable by `transformers` (`from_pretrained`)."""
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    dtypes = {t.dtype for t in state.values()}
    assert len(dtypes) == 1, dtypes
    dtype = dtypes.pop()
    (out / CONFIG_FILE).write_text(json.dumps(hf_config_dict(cfg, dtype, base_config), indent=2))
    groups = _parse_shards(state, max_shard_bytes)
    if len(groups) == 1:
        save_safetensors({k: state[k].contiguous() for k in groups[0]}, out / SINGLE_FILE)
    else:
        weight_map, total = {}, 0
        for i, names in enumerate(groups):
            file = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
            save_safetensors({k: state[k].contiguous() for k in names}, out / file)
            weight_map.update({k: file for k in names})
            total += sum(state[k].numel() * state[k].element_size() for k in names)
        (out / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total},
                                                  "weight_map": weight_map}, indent=2))
    if tokenizer_src is not None:
        copy_tokenizer_files(tokenizer_src, out)
    return out

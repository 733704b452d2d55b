"""HF directory <-> engine checkpoint (Megatron names, split by stage and tensor-parallel rank).

`hf2mcore` fuses HF tensors into Megatron's layout (key_maps), cuts the layers into stages
(`--pp N` or an explicit `--stage-layers` list), splits each tensor across `--tp` ranks and writes
`engine.checkpoint`'s format. `mcore2hf` merges stages and TP ranks back. Without a dtype change
the round trip is bit-identical. Both write a temporary sibling of the destination and rename it
into place (checkpoint_tools/output_dir.py): a non-empty destination is refused unless `force`
and it holds a previous checkpoint.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from spd_engine.checkpoint_tools import hf, key_maps, output_dir
from spd_engine.engine.model import checkpoint as ckpt
from spd_engine.engine.model.model_config import ModelConfig
from spd_engine.engine.protocol.topology import Topology, stage_bounds

SOURCE_HF_CONFIG = "hf_config.json"  # the source config.json, kept so mcore2hf can restore its extra fields


def cast_state(state: dict[str, torch.Tensor], dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """Cast to `dtype`, or check the state already has one dtype when `dtype` is None."""
    if dtype is None:
        dtypes = {t.dtype for t in state.values()}
        if len(dtypes) != 1:
            raise ValueError(f"the source mixes dtypes {sorted(map(str, dtypes))}; pass --dtype")
        return state
    return {k: t.to(dtype) for k, t in state.items()}


def split_stages(state: dict[str, torch.Tensor], cfg: ModelConfig, stage_layers: list[int], tp: int
                 ) -> dict[tuple[int, int], dict[str, torch.Tensor]]:
    """Unsharded engine state dict -> {(stage, tp rank): tensors that shard stores}."""
    key_maps.check_tp(cfg, tp)
    bounds = stage_bounds(stage_layers)
    shards: dict[tuple[int, int], dict[str, torch.Tensor]] = {
        (p, r): {} for p in range(len(stage_layers)) for r in range(tp)}
    for name, t in state.items():
        p = ckpt.owner_stage(name, bounds)
        for r, piece in enumerate(key_maps.shard_tensor(name, t, cfg, tp)):
            shards[(p, r)][name] = piece
    return shards


def write_engine(dst: str | Path, cfg: ModelConfig, state: dict[str, torch.Tensor], *,
                 pp: int | None = None, stage_layers: str | list[int] | None = None, tp: int = 1,
                 source_config: dict | None = None, tokenizer_src: str | Path | None = None,
                 force: bool = False, sources: tuple[Path, ...] = ()) -> ckpt.CheckpointIndex:
    """Write an unsharded engine state dict as an engine checkpoint with the given split, atomically
    (checkpoint_tools/output_dir.py): shards, the source HF config, the tokenizer files, then
    `index.json`, all in a temporary sibling renamed to `dst` at the end. `force` replaces a previous
    checkpoint at `dst`; `sources` are directories `dst` must not hold."""
    topo = Topology.build(cfg.num_layers, n=pp, stage_layers=stage_layers)
    shards = split_stages(state, cfg, list(topo.stage_layers), tp)
    with output_dir.atomic_output(dst, force=force, sources=sources) as tmp:
        index = ckpt.write_shards(tmp, cfg, list(topo.stage_layers), tp, shards)
        if source_config is not None:
            (tmp / SOURCE_HF_CONFIG).write_text(json.dumps(source_config, indent=2))
        if tokenizer_src is not None:
            hf.copy_tokenizer_files(tokenizer_src, tmp)
        ckpt.write_index(index)
    return dataclasses.replace(index, path=Path(dst))


def read_engine(src: str | Path, dtype: torch.dtype | None = None) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Every tensor of an engine checkpoint, stages and TP ranks merged (engine names)."""
    index = ckpt.read_index(src)
    L = index.cfg.num_layers
    ranks = [ckpt.load_stage_state(src, range(0, L), True, True, tp_rank=r) for r in range(index.tp)]
    state = key_maps.merge_state(ranks, index.cfg)
    return index.cfg, cast_state(state, dtype) if dtype is not None else state


def hf2mcore(src: str | Path, dst: str | Path, *, pp: int | None = None,
             stage_layers: str | list[int] | None = None, tp: int = 1,
             dtype: torch.dtype | None = None, force: bool = False) -> ckpt.CheckpointIndex:
    cfg, raw = hf.read_hf_config(src)
    key_maps.check_tp(cfg, tp)
    topo = Topology.build(cfg.num_layers, n=pp, stage_layers=stage_layers)  # fail before reading weights
    output_dir.check_destination(Path(dst), force, (Path(src),))  # refused before the weights are read
    state = key_maps.hf_to_mcore(cast_state(hf.read_hf_state(src), dtype), cfg)
    return write_engine(dst, cfg, state, stage_layers=list(topo.stage_layers), tp=tp, source_config=raw,
                        tokenizer_src=src, force=force, sources=(Path(src),))


def mcore2hf(src: str | Path, dst: str | Path, *, dtype: torch.dtype | None = None,
             max_shard_bytes: int = hf.DEFAULT_MAX_SHARD_BYTES, force: bool = False) -> Path:
    """An engine checkpoint -> an HF directory at `dst`, written atomically (checkpoint_tools/output_dir.py)."""
    output_dir.check_destination(Path(dst), force, (Path(src),))  # refused before the weights are read
    cfg, state = read_engine(src, dtype)
    base_path = Path(src) / SOURCE_HF_CONFIG
    base = json.loads(base_path.read_text()) if base_path.is_file() else None
    with output_dir.atomic_output(dst, force=force, sources=(Path(src),)) as tmp:
        hf.write_hf_dir(tmp, cfg, key_maps.mcore_to_hf(state, cfg), base_config=base,
                        tokenizer_src=src, max_shard_bytes=max_shard_bytes)
    return Path(dst)

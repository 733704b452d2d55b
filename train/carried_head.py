"""Shipped heads carried over from another stage split, built when first used.

A head carried over untrained (train/head_transplant.py) holds no information beyond its source
head and its split, so the repository ships it as `heads/<name>/carried.json` naming the source
head (a sibling directory) and the split; the first command that needs it builds the PDM into the
cache (`$SPD_CACHE/heads/<name>-<key>`, the key hashing the manifest and the source's files) and
reuses it after. The head is the one `spd train --init-head SOURCE --steps 0` would start from.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import torch

from spd_engine.checkpoint_tools.fetch import cache_root
from spd_engine.engine.model.model_config import ModelConfig
from spd_engine.engine.model.pdm import PDM, PDM_FILES, PDMConfig, load_pdm, read_pdm_config, save_pdm
from spd_engine.train.head_transplant import transplant

CARRIED = "carried.json"
CARRIED_FORMAT = "spd-pdm-carried-v1"


def is_carried(head_dir: Path) -> bool:
    return (head_dir / CARRIED).is_file()


def read_manifest(head_dir: Path) -> tuple[Path, tuple[int, ...], tuple[int, ...]]:
    """(source head dir, stage layers, anchors) of a carried head; ValueError naming what is wrong."""
    path = head_dir / CARRIED
    try:
        spec = json.loads(path.read_text())
        if spec.get("format") != CARRIED_FORMAT:
            raise ValueError(f"format {spec.get('format')!r}, expected {CARRIED_FORMAT!r}")
        source = head_dir.parent / str(spec["source"])
        layers, anchors = tuple(int(x) for x in spec["stage_layers"]), tuple(int(x) for x in spec["anchors"])
    except (OSError, KeyError, TypeError, ValueError) as err:
        raise ValueError(f"carried head manifest {path} is unreadable: {err}") from err
    if not (source / "pdm.json").is_file():
        raise ValueError(f"carried head {head_dir} names source head {source}, which is not a PDM checkpoint")
    return source, layers, anchors


def _key(head_dir: Path, source: Path) -> str:
    digest = hashlib.sha256((head_dir / CARRIED).read_bytes())
    for f in sorted(source.iterdir()):
        if f.name == "pdm.json" or f.name.startswith(PDM_FILES.stem):
            digest.update(f.name.encode() + f.read_bytes())
    return digest.hexdigest()[:16]


def materialize(head_dir: Path, target: ModelConfig, cache: Path | None = None) -> Path:
    """The built PDM directory of the carried head `head_dir` for `target` (built once, then cached)."""
    source, layers, anchors = read_manifest(head_dir)
    out = (cache or cache_root()) / "heads" / f"{head_dir.name}-{_key(head_dir, source)}"
    if (out / "pdm.json").is_file():
        return out
    src_cfg, _ = read_pdm_config(source)
    src = load_pdm(source, target, src_cfg.stage_layers)
    pcfg = PDMConfig(layers, anchors, src_cfg.num_layers, src_cfg.draft_vocab, src_cfg.target_fingerprint)
    with torch.no_grad():
        head = transplant(src, PDM(target, pcfg))
    tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    save_pdm(head, tmp, extra={"carried_from": source.name}, dtype=torch.float16)
    try:
        os.replace(tmp, out)  # atomic: readers see a whole head or none
    except OSError:  # a concurrent builder got there first: its copy is the same head
        shutil.rmtree(tmp, ignore_errors=True)
        if not (out / "pdm.json").is_file():
            raise
    return out

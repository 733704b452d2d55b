"""The repository travels as its tracked files (a GPU host gets a copy, without network): their
size stays under a budget that the shipped heads must fit (docs/gpu-check.md, "Repository size")."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BUDGET_BYTES = 48 * 2**20


def tracked_files() -> list[Path]:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: no tracked files to measure")
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    return [ROOT / p.decode() for p in out.split(b"\0") if p]


def test_tracked_files_fit_the_budget() -> None:
    files = tracked_files()
    sizes = {f: f.stat().st_size for f in files if f.is_file()}  # a tracked file deleted in the tree: not copied
    total = sum(sizes.values())
    largest = sorted(sizes.items(), key=lambda kv: -kv[1])[:5]
    assert total < BUDGET_BYTES, (f"tracked files {total / 2**20:.1f} MiB >= {BUDGET_BYTES / 2**20:.0f} MiB; largest: "
                                  + ", ".join(f"{p.relative_to(ROOT)} {s / 2**20:.1f} MiB" for p, s in largest))


def test_every_shipped_head_loads_from_its_compact_form() -> None:
    """Each head directory holds exactly one weights file, int4 groups or zlib-compressed int8, or
    is a carried-over head's manifest (no weights: built from its source head, train/carried_head.py)."""
    import torch

    from spd_engine.engine.model.head_zlib import load_weights
    from spd_engine.train.carried_head import is_carried, read_manifest

    heads = sorted(p for p in (ROOT / "heads").iterdir() if p.is_dir())
    assert heads
    for head in heads:
        if is_carried(head):
            assert not list(head.glob("pdm.safetensors*")), head.name
            assert not is_carried(read_manifest(head)[0]), head.name  # its source ships weights
            continue
        stem = "eagle" if (head / "eagle.json").is_file() else "pdm"
        files = sorted(head.glob(f"{stem}.safetensors*"))
        assert len(files) == 1, (head.name, files)
        state = load_weights(head / f"{stem}.safetensors")
        quantized = {t.dtype for t in state.values() if t.dim() == 2 and t.dtype in (torch.int8, torch.uint8)}
        assert quantized, head.name  # int8 rows or int4 pairs, never a float copy of the matrices

"""Lossless compression of a head's weights file: `<stem>.safetensors.zlib` holds the zlib stream of
the very bytes of `<stem>.safetensors`.

The shipped heads travel with the repository, whose tracked size has a budget
(tests/test_repo_size.py). Int8 weights (engine/model/pdm_quant.py) use about 6 of their 8 bits, so
zlib takes about a fifth off a head file without changing a single stored value: a compressed
head loads bit for bit the tensors of the uncompressed one, and its acceptance cannot move.
Loading reads `<stem>.safetensors` when it is there, else the `.zlib` file (decompressed in
memory, about 0.1 s for a shipped head).
"""
from __future__ import annotations

import zlib
from pathlib import Path

import torch

ZLIB_SUFFIX = ".zlib"


def compressed_path(wpath: str | Path) -> Path:
    wpath = Path(wpath)
    return wpath.with_name(wpath.name + ZLIB_SUFFIX)


def weights_exist(wpath: str | Path) -> bool:
    """The weights file or its compressed form is there."""
    return Path(wpath).is_file() or compressed_path(wpath).is_file()


def load_weights(wpath: str | Path) -> dict[str, torch.Tensor]:
    """The tensors of `wpath`, or of its `.zlib` form; ValueError when neither is readable.
    (safetensors' own errors of a corrupt file pass up to the caller, which names the file.)"""
    from safetensors.torch import load, load_file

    wpath = Path(wpath)
    if wpath.is_file():
        return load_file(str(wpath))
    zpath = compressed_path(wpath)
    if not zpath.is_file():
        raise ValueError(f"weights missing: {wpath} (nor {zpath.name})")
    try:
        data = zlib.decompress(zpath.read_bytes())
    except zlib.error as err:
        raise ValueError(f"corrupt compressed weights {zpath}: {err}") from None
    return load(data)


def compress_weights(wpath: str | Path, level: int = 9) -> Path:
    """Replace `wpath` by its `.zlib` form; returns the new path."""
    wpath = Path(wpath)
    zpath = compressed_path(wpath)
    zpath.write_bytes(zlib.compress(wpath.read_bytes(), level))
    wpath.unlink()
    return zpath

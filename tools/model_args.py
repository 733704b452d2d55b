"""The shipped head for a model and n (a carried-over head built into the cache on first use); model
resolution itself is checkpoint_tools/model_source.py, re-exported here for the commands."""
from __future__ import annotations

from pathlib import Path

from spd_engine.checkpoint_tools.model_source import (  # noqa: F401 (re-exported: the commands' one import)
    BUILTIN_MODELS,
    check_hf_config,
    check_tokenizer,
    hf_model_dir,
    model_config,
    resolve_model,
    text_needs_tokenizer,
)

REPO_HEADS = Path(__file__).resolve().parents[1] / "heads"  # site-packages/spd_engine/heads when installed


def default_head(model: str, n: int, mode: str = "spd") -> str:
    """The shipped trained head for a built-in model at this n (--mode eagle: its EAGLE head; a head
    shipped as carried over from another split: built into the cache), else an untrained one."""
    if mode == "eagle":
        candidate = REPO_HEADS / f"{model}-eagle"
        return str(candidate) if (candidate / "eagle.json").is_file() else "random"
    candidate = REPO_HEADS / f"{model}-n{n}"
    if (candidate / "pdm.json").is_file():
        return str(candidate)
    from spd_engine.train.carried_head import is_carried

    return carried_or_given(str(candidate), model) if is_carried(candidate) else "random"


def carried_or_given(spec: str, model: str) -> str:
    """A head directory as given, or, where it holds a carried-head manifest (a head carried over
    to another split, `carried.json`), the head it builds into the cache on first use."""
    from spd_engine.train.carried_head import is_carried, materialize

    if spec == "random" or not is_carried(Path(spec)):
        return spec
    return str(materialize(Path(spec), model_config(resolve_model(model)[0])))

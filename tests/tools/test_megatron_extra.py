"""The `megatron` extra is a version range (a newer megatron-core is kept, not downgraded) that holds
the version `make install` puts in and the tests run."""
from __future__ import annotations

import configparser
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_the_extra_is_a_range_holding_the_installed_version():
    requirements = pytest.importorskip("packaging.requirements")
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    lines = [x.strip() for x in cfg["options.extras_require"]["megatron"].splitlines()
             if x.strip() and not x.strip().startswith("#")]
    assert len(lines) == 1
    req = requirements.Requirement(lines[0])
    assert req.name == "megatron-core" and not any(s.operator == "==" for s in req.specifier), lines[0]
    installed = re.search(r"--no-deps megatron-core==([0-9.]+)", (ROOT / "Makefile").read_text()).group(1)
    assert installed in req.specifier and "99.0" not in req.specifier  # bounded above

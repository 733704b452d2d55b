"""A run directory's state.pt is loaded with torch's weights_only loader: a planted file that would
run code when unpickled is refused (ValueError, CLI exit 2) and its payload never runs."""
from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest
import torch
from test_distill import stream, target, tcfg

from spd_engine.train.distill import Trainer
from spd_engine.train.head_training import load_state


class Payload:
    """Unpickling this runs `touch MARKER`."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_payload_runs_under_a_plain_load(tmp_path: Path) -> None:
    """Control: torch.load without weights_only does run it."""
    torch.save({"step": Payload(tmp_path / "ran")}, tmp_path / "x.pt")
    torch.load(tmp_path / "x.pt", weights_only=False)
    assert (tmp_path / "ran").exists()


def test_hostile_state_is_refused_on_resume(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    (tmp_path / "run").mkdir()
    torch.save({"step": 3, "pdm": Payload(marker)}, tmp_path / "run" / "state.pt")
    with pytest.raises(ValueError, match="state.pt is not a training state"):
        Trainer(target(), tcfg(tmp_path / "run"), stream(), log=lambda m: None)
    assert not marker.exists()


def test_damaged_state_is_a_value_error(tmp_path: Path) -> None:
    (tmp_path / "state.pt").write_bytes(pickle.dumps([1, 2])[:3])
    with pytest.raises(ValueError, match="state.pt"):
        load_state(tmp_path / "state.pt")

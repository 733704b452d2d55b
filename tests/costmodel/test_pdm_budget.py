"""The PDM layer budget: driver work at each K against the slowest stage, on a hand profile."""
from __future__ import annotations

import pytest

from spd_engine.costmodel.cost_inputs import Profile
from spd_engine.tools.experiments.pdm_budget import budget, main

pytestmark = pytest.mark.pure  # the fast tier: logic only, no process, no model file

HAND = {"name": "hand", "num_layers": 8, "layer_ms": 0.1, "pdm_ms": 0.5, "verify_ms": 0.05, "hidden_size": 64,
        "driver_fixed_ms": 0.02}


def test_each_layer_costs_one_target_layer_and_the_largest_fitting_k_is_named():
    prof = Profile.from_dict(HAND)
    got = budget(prof, 2, 6)  # stage: 4 layers = 0.4 ms; work(K) = 0.5 + (K - 2) 0.1 + 0.02 + 0.05
    assert got["stage_ms"] == pytest.approx(0.4)
    assert [got["driver_ms"][k] for k in (1, 2, 3)] == pytest.approx([0.47, 0.57, 0.67])
    assert got["hidden_k"] == 0  # not even K = 1 fits in 0.4 ms
    assert budget(Profile.from_dict({**HAND, "pdm_ms": 0.2}), 2, 6)["hidden_k"] == 3  # 0.17, 0.27, 0.37, 0.47
    assert budget(Profile.from_dict({**HAND, "pdm_ms": 0.2}), 2, 6, measured_k=1)["hidden_k"] == 2  # 0.27, 0.37


def test_cli_prints_the_reference_table_and_refuses_bad_n(capsys):
    assert main(["--reference", "smollm2-135m-h200", "--n", "4,8"]) == 0
    out = capsys.readouterr().out
    assert "smollm2-135m-h200 | 4 |" in out and "ASSUMPTION" in out
    assert main(["--n", "four"]) == 2 and "--n takes" in capsys.readouterr().err

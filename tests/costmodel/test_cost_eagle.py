"""The eagle row of the cost model (costmodel/cost_eagle.py): tokens per round, round time from the
profile, the best k for an alpha, inputs from an eval report, and `spd plan` printing the row."""
from __future__ import annotations

import json

import pytest

from spd_engine.costmodel.cost_alternatives import ar_token_ms
from spd_engine.costmodel.cost_eagle import EagleInputs, eagle_inputs_from_eval, eagle_row, tokens_per_round
from spd_engine.costmodel.cost_inputs import REFERENCE_PROFILES, Profile

pytestmark = pytest.mark.pure  # the fast tier: logic only, no process, no model file

PROFILE = Profile.from_dict({"num_layers": 4, "layer_ms": 1.0, "pdm_ms": 0.5, "verify_ms": 0.2, "hidden_size": 64})


def test_tokens_per_round():
    assert tokens_per_round(0.0, 4) == 1.0
    assert tokens_per_round(1.0, 4) == 5.0
    assert tokens_per_round(0.5, 2) == pytest.approx(1.75)  # 1 + 1/2 + 1/4


def test_round_time_and_speedup():
    row = eagle_row(PROFILE, EagleInputs(alpha=0.5, k=2), [])
    assert row["draft_step_ms"] == pytest.approx(1.2)  # one layer + the head
    assert row["target_pass_ms"] == pytest.approx(ar_token_ms(PROFILE)) == pytest.approx(4.2)
    assert row["round_ms"] == pytest.approx(2 * 1.2 + 4.2)
    assert row["tok_s"] == pytest.approx(1e3 * 1.75 / 6.6)
    assert row["speedup_vs_ar"] == pytest.approx(4.2 * 1.75 / 6.6)


def test_best_k_and_measured_length():
    rows = {k: eagle_row(PROFILE, EagleInputs(alpha=0.8, k=k), [])["tok_s"] for k in range(1, 9)}
    best = eagle_row(PROFILE, EagleInputs(alpha=0.8), [])
    assert best["tok_s"] == max(rows.values()) and rows[best["k"]] == best["tok_s"]
    assert eagle_row(PROFILE, EagleInputs(alpha=0.0), [])["k"] == 1  # nothing accepted: the shortest chain
    measured = eagle_row(PROFILE, EagleInputs(acceptance_length=2.0, k=3), [])
    assert measured["tok_s"] == pytest.approx(1e3 * 2.0 / (3 * 1.2 + 4.2))


def test_inputs_are_checked():
    for bad in (dict(), dict(alpha=0.5, acceptance_length=2.0, k=2), dict(alpha=1.5), dict(acceptance_length=2.0),
                dict(acceptance_length=5.0, k=3), dict(alpha=0.5, k=0)):
        with pytest.raises(ValueError):
            EagleInputs(**bad)
    report = {"mode": "eagle", "eagle_k": 4, "overall": {"eal": 2.5}}
    assert eagle_inputs_from_eval(report, None) == EagleInputs(acceptance_length=2.5, k=4)
    with pytest.raises(ValueError, match="measured k=4"):
        eagle_inputs_from_eval(report, 3)
    with pytest.raises(ValueError, match="spd eval --mode eagle"):
        eagle_inputs_from_eval({**report, "mode": "spd"}, None)


def test_plan_prints_the_eagle_row(tmp_path, capsys):
    from spd_engine.tools.cli import main

    ref = "smollm2-135m-h200"
    report = tmp_path / "eagle.json"
    report.write_text(json.dumps({"mode": "eagle", "eagle_k": 3, "overall": {"eal": 2.0}}))
    assert main(["plan", "--reference", ref, "--assume-link", "5,100", "--alpha", "0.5", "--n", "4",
                 "--eagle-json", str(report), "--json", str(tmp_path / "plan.json")]) == 0
    out = capsys.readouterr().out
    assert "# eagle (serial draft-then-verify, one device, measured acceptance length): k=3" in out
    row = json.loads((tmp_path / "plan.json").read_text())["eagle"]
    profile = Profile.from_dict({**REFERENCE_PROFILES[ref], "name": ref})
    assert row == pytest.approx(eagle_row(profile, EagleInputs(acceptance_length=2.0, k=3), []))
    assert main(["plan", "--reference", ref, "--assume-link", "5,100", "--alpha", "0.5", "--eagle-k", "2"]) == 2

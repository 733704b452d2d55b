"""Predicted branch-width rows (costmodel/cost_branches.py, spd plan --branches-json)."""
from __future__ import annotations

import json

import pytest

from spd_engine.costmodel.cost_branches import branch_rows, parse_width_cost, read_branch_report
from spd_engine.costmodel.cost_inputs import REFERENCE_PROFILES, LinkModel, Profile

pytestmark = pytest.mark.pure  # the fast tier: logic only, no process, no model file

REPORT = {"n": 4, "groups": {"overall": {"suffix>=2": {"eal": 2.0}, "pdm": {"eal": 1.4}}},
          "branches": {"overall": {"W=2 refill suffix>=2": {"eal": 2.2, "tokens_per_step": 1.3},
                                   "W=2 refill pdm": {"eal": 1.5, "tokens_per_step": 1.45},
                                   "W=4 always suffix>=2": {"eal": 2.3, "tokens_per_step": 2.2}}}}


def profile() -> Profile:
    return Profile.from_dict({**REFERENCE_PROFILES["llama-3.1-8b-h200"], "name": "ref"})


def test_report_rows_of_one_policy():
    assert read_branch_report(REPORT, "refill suffix>=2") == {1: (2.0, 1.0), 2: (2.2, 1.3)}
    assert read_branch_report(REPORT, "refill pdm") == {1: (1.4, 1.0), 2: (1.5, 1.45)}
    with pytest.raises(ValueError, match="no branch rows"):
        read_branch_report(REPORT, "always pdm")
    with pytest.raises(ValueError, match="draft-policies"):
        read_branch_report({"groups": {}}, "refill pdm")


def test_free_chains_scale_tokens_per_second_with_eal():
    link = LinkModel.assume("fast", 3.0, 400.0, 8.0)
    free = profile()
    rows = branch_rows(free, lambda a, b: link, 4, False, {1: (2.0, 1.0), 2: (2.2, 1.0)}, {2: 1.0}, [])
    assert rows[1]["tick_ms"] == pytest.approx(rows[0]["tick_ms"])  # no W-token steps: the same tick
    assert rows[1]["tok_s"] / rows[0]["tok_s"] == pytest.approx(2.2 / 2.0)
    costly = branch_rows(free, lambda a, b: link, 4, False, {1: (2.0, 1.0), 2: (2.2, 2.0)}, {2: 2.0}, [])
    assert costly[1]["tick_ms"] > rows[0]["tick_ms"] * 1.5  # every step carries two tokens at twice the cost
    with pytest.raises(ValueError, match="--width-cost 4"):
        branch_rows(free, lambda a, b: link, 4, False, {1: (2.0, 1.0), 4: (2.3, 2.0)}, {2: 1.0}, [])


def test_width_cost_parsing():
    assert parse_width_cost("2:1.0,4:1.9") == {2: 1.0, 4: 1.9}
    for bad in ("2=1", "1:1.0", "2:0.5"):
        with pytest.raises(ValueError, match="--width-cost"):
            parse_width_cost(bad)


def test_spd_plan_prints_predicted_branch_rows(tmp_path, capsys):
    from spd_engine.tools.cli import main

    path = tmp_path / "policies.json"
    path.write_text(json.dumps(REPORT))
    out = tmp_path / "plan.json"
    assert main(["plan", "--reference", "llama-3.1-8b-h200", "--alpha", "0.6", "--n", "4", "--assume-link",
                 "3,400,8", "--branches-json", str(path), "--json", str(out)]) == 0
    assert "PREDICTED" in capsys.readouterr().out
    rows = json.loads(out.read_text())["branches"]["rows"]["sep"]
    assert [r["W"] for r in rows] == [1, 2] and all(r["predicted"] for r in rows)


def test_branch_chains_are_verified_by_the_driver():
    """With verification on the last stage a one-token exit is verified there, a branch point's
    chains by the driver: at one W-token step per tick (f = 1) every verification is the
    driver's, as with --verify-at driver; W = 1 keeps the head on the last stage."""
    link = LinkModel.assume("fast", 3.0, 400.0, 8.0)
    measured = {1: (2.0, 1.0), 2: (2.2, 2.0)}
    last = branch_rows(profile(), lambda a, b: link, 4, False, measured, {2: 1.0}, [])
    driver = branch_rows(profile(), lambda a, b: link, 4, False, measured, {2: 1.0}, [], verify_on_last=False)
    assert last[1]["tick_ms"] == pytest.approx(driver[1]["tick_ms"])
    assert last[0]["tick_ms"] != pytest.approx(driver[0]["tick_ms"])

"""Predicted throughput and per-request latency with B requests in the pipeline (costmodel/cost_batch.py,
spd plan --batch)."""
from __future__ import annotations

import json

import pytest

from spd_engine.costmodel.cost_batch import batch_row, batch_rows, parse_batches, replay_batch, width_ratio
from spd_engine.costmodel.cost_inputs import REFERENCE_PROFILES, LinkModel, Profile
from spd_engine.costmodel.cost_model_spd import build_spd_case, spd_cycles
from spd_engine.costmodel.cost_partitions import stage_times
from spd_engine.engine.protocol.schedule import expected_eal
from spd_engine.engine.protocol.topology import default_stage_layers

pytestmark = pytest.mark.pure

LINK = LinkModel.assume("fast", 3.0, 400.0, 8.0)
FREE = {2: 1.0, 4: 1.0, 8: 1.0}  # memory-bound decode: B rows cost one row's time
CPU = {2: 1.64, 3: 1.80, 4: 1.48}  # docs/results/branch-width-step.md, a stage step of W rows (run 3)


def profile() -> Profile:
    return Profile.from_dict({**REFERENCE_PROFILES["smollm2-135m-h200"], "name": "ref"})


def rows_for(batches, cost, colocate=True, alpha=0.7, **kw):
    replays = {b: replay_batch(4, b, alpha, requests=8, tokens=48, **kw) for b in batches}
    return batch_rows(profile(), lambda a, b: LINK, 4, alpha, batches, colocate, cost, [], replays=replays)


def test_width_ratio_measured_interpolated_refused():
    notes: list[str] = []
    assert width_ratio(CPU, 1, notes) == 1.0 and width_ratio(CPU, 2, notes) == 1.64 and not notes
    assert width_ratio({2: 1.5, 4: 2.5}, 3, notes) == pytest.approx(2.0) and "interpolated" in notes[0]
    with pytest.raises(ValueError, match="--width-cost 8"):
        width_ratio(CPU, 8, notes)
    with pytest.raises(ValueError, match="rows"):
        width_ratio(CPU, 0, notes)


def test_one_request_is_the_single_stream_tick_protocol():
    r = replay_batch(4, 1, 1.0, requests=3, tokens=20)
    # every draft accepted: each request takes (N - 1) + (n - 1) ticks, back to back
    assert r.ticks == 3 * (19 + 3) and r.decode_tokens == 57 and r.rows_per_step == 1.0
    assert r.own_ticks_per_token == pytest.approx(22 / 19) == r.latency_ticks_per_token
    # stages idle only while each request fills (and drains: the next one enters only after the last commit)
    assert r.utilization[0] == 1.0 and r.utilization[3] == pytest.approx(1 - 3 * 3 / r.ticks)


def test_every_b_replays_the_same_requests_with_the_same_schedules():
    rs = {b: replay_batch(4, b, 0.6, requests=8, tokens=40) for b in (1, 2, 4, 8)}
    assert len({r.own_ticks_per_token for r in rs.values()}) == 1  # each request keeps its own schedule
    assert len({r.decode_tokens for r in rs.values()}) == 1
    ticks = [rs[b].ticks for b in (1, 2, 4, 8)]
    assert ticks == sorted(ticks, reverse=True) and ticks[-1] < ticks[0] / 4  # more requests per tick
    util = [rs[b].overall_utilization for b in (1, 2, 4, 8)]
    assert util == sorted(util) and util[0] < 0.8 < util[-1]  # other requests fill the rejections' bubbles
    # the same alpha priced by the tick formula
    assert 4 / rs[1].own_ticks_per_token == pytest.approx(expected_eal(4, 0.6), rel=0.15)


def test_fewer_rows_than_requests_make_requests_wait():
    full = replay_batch(4, 4, 0.6, requests=8, tokens=40)
    half = replay_batch(4, 4, 0.6, requests=8, tokens=40, max_rows=2)
    assert half.own_ticks_per_token == full.own_ticks_per_token  # no request's schedule changes...
    assert half.latency_ticks_per_token > full.latency_ticks_per_token  # ...but a held one waits for a row
    assert max(max(rows) for rows in half.stage_rows) == 2 and half.ticks > full.ticks


def test_free_rows_scale_throughput_and_keep_latency():
    rows = rows_for([1, 2, 4, 8], FREE)
    assert [r["B"] for r in rows] == [1, 2, 4, 8] and all(r["predicted"] for r in rows)
    assert all(r["tick_ms"] == pytest.approx(rows[0]["tick_ms"]) for r in rows)
    ticks = {b: replay_batch(4, b, 0.7, requests=8, tokens=48).ticks for b in (1, 2, 4, 8)}
    for r in rows:  # tokens per tick grow with the rows; each request's TPOT stays
        assert r["tok_s_x"] == pytest.approx(ticks[1] / ticks[r["B"]])
        assert r["tpot_ms"] == pytest.approx(rows[0]["tpot_ms"])


def test_costly_rows_trade_latency_for_throughput():
    cost = {2: 2.0, 4: 4.0}  # compute-bound: a row costs what a one-row step does
    rows = rows_for([1, 2, 4], cost, colocate=False)
    two = rows[1]
    assert two["tpot_x"] > 1.6  # every step of the critical path carries two rows
    assert two["tok_s_x"] < 1.2  # and throughput gains little
    cheap = rows_for([1, 2], {2: 1.2}, colocate=False)[1]
    assert 1.0 < cheap["tpot_x"] < two["tpot_x"] and cheap["tok_s_x"] > two["tok_s_x"]


def test_b1_prices_as_the_plan_prices_one_request():
    """B = 1: the steady cycle of the plan's own SPD case on the engine's default split."""
    prof = profile()
    replay = replay_batch(4, 1, 0.7, requests=4, tokens=64)
    row = batch_row(prof, lambda a, b: LINK, replay, 0.7, True, {}, [])
    stages = stage_times(prof, default_stage_layers(prof.num_layers, 4))
    case = build_spd_case(stages, prof.driver_work_for(4, []), prof.verify_ms, 0.7, True, prof.hidden,
                          prof.dtype_bytes, prof.anchors, lambda a, b: LINK)
    assert row["tick_ms"] == pytest.approx(max(spd_cycles(case).values()))
    assert row["tpot_ms"] == pytest.approx(row["tick_ms"] * 4 / row["eal"])


def test_parse_batches():
    assert parse_batches("1,2,4,8") == [1, 2, 4, 8]
    for bad in ("0,2", "two", ""):
        with pytest.raises(ValueError, match="--batch"):
            parse_batches(bad)
    with pytest.raises(ValueError, match="requests"):
        replay_batch(4, 2, 0.5, requests=0)
    with pytest.raises(ValueError, match="alpha"):
        replay_batch(4, 2, 1.5)


def test_spd_plan_prints_predicted_batch_rows(tmp_path, capsys):
    from spd_engine.tools.cli import main

    out = tmp_path / "plan.json"
    assert main(["plan", "--reference", "smollm2-135m-h200", "--alpha", "0.7", "--n", "2", "--assume-link",
                 "3,400,8", "--batch", "1,2", "--batch-requests", "4", "--batch-tokens", "24", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "several requests at n=2" in text and "PREDICTED" in text and "ASSUMED" in text
    result = json.loads(out.read_text())["batch"]
    assert [r["B"] for r in result["rows"]] == [1, 2, 1, 2] and all(r["predicted"] for r in result["rows"])
    assert main(["plan", "--reference", "smollm2-135m-h200", "--alpha", "0.7", "--n", "2", "--assume-link",
                 "3,400,8", "--batch", "16"]) != 0
    assert "--width-cost 16:RATIO" in capsys.readouterr().err
    assert main(["plan", "--validate", "--batch", "1,2"]) != 0
    assert "--batch prices a plan" in capsys.readouterr().err

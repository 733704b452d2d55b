"""Speedups with their spread over repeats and the noisy mark (bench/speedups.py), and the eagle
row's head budget against the PDM heads: the arithmetic, on hand-made rows and head directories."""
from __future__ import annotations

import json

import pytest

from spd_engine.bench.speedups import add_speedups, head_budget_note, noisy_lines, ratio_cell, ratio_spread, training_tokens
from spd_engine.tools.model_args import REPO_HEADS

pytestmark = pytest.mark.pure


def test_ratios_pair_repeats_of_the_same_index():
    out = ratio_spread([20.0, 30.0, 18.0], [10.0, 20.0, 18.0])  # per repeat: 2.0, 1.5, 1.0
    assert out["per_repeat"] == [2.0, 1.5, 1.0]
    assert (out["median"], out["min"], out["max"]) == (1.5, 1.0, 2.0)
    # the ratio of the medians (20 / 18) is not what is reported: pairing by repeat is
    assert out["median"] != pytest.approx(20.0 / 18.0)


def test_a_spread_wider_than_the_gain_is_noisy():
    noisy = ratio_spread([11.0, 12.0, 10.0], [10.0, 10.0, 10.0])  # 1.1, 1.2, 1.0: spread 0.2 > gain 0.1
    assert noisy["noisy"] and noisy["noisy_reason"] == "spread 0.200 wider than the gain 0.100"
    clear = ratio_spread([13.0, 14.0, 12.0], [10.0, 10.0, 10.0])  # 1.3, 1.4, 1.2: spread 0.2 < gain 0.3
    assert not clear["noisy"] and clear["noisy_reason"] is None
    loss = ratio_spread([5.0, 6.0, 5.5], [10.0, 10.0, 10.0])  # a loss counts as much as a gain: |0.55 - 1|
    assert not loss["noisy"]


def test_a_single_repeat_is_noisy_however_large_the_gain():
    out = ratio_spread([30.0], [10.0])
    assert out["median"] == 3.0 and out["noisy"] and out["noisy_reason"] == "a single repeat"


def test_ratio_user_errors_and_a_baseline_without_a_rate():
    with pytest.raises(ValueError, match="unequal length"):
        ratio_spread([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="at least one repeat"):
        ratio_spread([], [])
    assert ratio_spread([1.0], [0.0]) is None  # no decode tokens in the baseline: nothing to divide by


def rows_of_one_run() -> list[dict]:
    return [{"name": "ar", "decode_tok_s_per_repeat": [10.0, 10.0, 10.0]},
            {"name": "pp", "decode_tok_s_per_repeat": [9.0, 9.5, 9.2]},
            {"name": "spd-colocate", "decode_tok_s_per_repeat": [11.0, 12.0, 10.0]},
            {"name": "hf-lookup", "decode_tok_s_per_repeat": [13.0, 14.0, 12.0]}]


def test_every_row_gets_every_baseline_the_run_has():
    rows = rows_of_one_run()
    add_speedups(rows)
    by = {r["name"]: r for r in rows}
    spd = by["spd-colocate"]
    assert spd["speedup_vs_ar"] == pytest.approx(1.1) and spd["speedup_vs_ar_noisy"]
    assert (spd["speedup_vs_ar_min"], spd["speedup_vs_ar_max"]) == pytest.approx((1.0, 1.2))
    assert spd["speedup_vs_pp_per_repeat"] == pytest.approx([11 / 9, 12 / 9.5, 10 / 9.2])
    assert spd["speedup_vs_hf_lookup"] == pytest.approx(11 / 13) and not spd["speedup_vs_hf_lookup_noisy"]
    assert "speedup_vs_hf" not in spd  # no plain hf row in this run
    # a baseline against itself is exactly 1 and not a measurement: never noisy, even from one repeat
    assert by["ar"]["speedup_vs_ar"] == 1.0 and not by["ar"]["speedup_vs_ar_noisy"]
    one = [{"name": "ar", "decode_tok_s_per_repeat": [10.0]}, {"name": "spd", "decode_tok_s_per_repeat": [12.0]}]
    add_speedups(one)
    assert not one[0]["speedup_vs_ar_noisy"] and one[1]["speedup_vs_ar_noisy"]
    assert one[0]["speedup_vs_pp"] is None  # the run has no pp row: reported as none, as before


def test_table_cells_and_the_reasons_under_the_table():
    rows = rows_of_one_run()
    add_speedups(rows)
    by = {r["name"]: r for r in rows}
    assert ratio_cell(by["spd-colocate"], "ar") == "1.10 (1.00-1.20) noisy"
    assert ratio_cell(by["hf-lookup"], "ar") == "1.30 (1.20-1.40)"
    assert ratio_cell(by["ar"], "ar") == "1.00"  # no range where all repeats agree
    assert ratio_cell(by["ar"], "hf") == ""
    lines = noisy_lines(rows)
    assert "noisy: spd-colocate x ar: spread 0.200 wider than the gain 0.100" in lines
    assert all("hf-lookup x ar" not in line for line in lines)
    one = [{"name": "ar", "decode_tok_s_per_repeat": [10.0]}, {"name": "spd", "decode_tok_s_per_repeat": [12.0]},
           {"name": "pp", "decode_tok_s_per_repeat": [9.0]}]
    add_speedups(one)
    assert ratio_cell(one[1], "ar") == "1.20 noisy"
    assert noisy_lines(one) == ["noisy: every ratio rests on a single repeat (--repeats 1): no spread to judge it by"]


def write_head(path, history_tokens: int | None, meta_tokens: int | None, meta: str = "pdm.json"):
    path.mkdir()
    if history_tokens is not None:
        (path / "train_history.json").write_text(json.dumps([{"step": 1, "tokens": 1024},
                                                             {"step": 2, "tokens": history_tokens}]))
    (path / meta).write_text(json.dumps({"train": {"tokens": meta_tokens}} if meta_tokens else {}))
    return str(path)


def test_training_tokens_prefer_the_history_over_the_last_phase(tmp_path):
    # a fine-tuned head: its metadata counts the fine-tune only, the history every phase
    assert training_tokens(write_head(tmp_path / "a", 4_812_800, 1_536_000)) == \
        (4_812_800, str(tmp_path / "a" / "train_history.json"))
    assert training_tokens(write_head(tmp_path / "b", None, 358_400, "eagle.json")) == \
        (358_400, str(tmp_path / "b" / "eagle.json"))
    assert training_tokens(write_head(tmp_path / "c", None, None)) is None


def test_the_eagle_note_names_the_budget_it_falls_short_of(tmp_path):
    eagle = write_head(tmp_path / "eagle", 358_400, 358_400, "eagle.json")
    heads = {"n4 PDM head": write_head(tmp_path / "n4", 4_812_800, 1_536_000),
             "n2 PDM head": write_head(tmp_path / "n2", 409_600, 409_600), "random": "random"}
    out = head_budget_note(eagle, heads)
    assert out["under_trained"] and out["reference"] == "n4 PDM head" and out["reference_tokens"] == 4_812_800
    assert out["note"] == "under-trained head: 0.36 M tokens against 4.81 M (n4 PDM head)"
    small = {"small PDM head": write_head(tmp_path / "small", 300_000, 300_000)}
    level = head_budget_note(eagle, small)
    assert level["under_trained"] is False and level["note"] == "head 0.36 M tokens"
    assert head_budget_note("random", heads)["note"] == "untrained (random) head"
    unknown = head_budget_note(write_head(tmp_path / "bare", None, None, "eagle.json"), heads)
    assert unknown["under_trained"] is None and "not recorded" in unknown["note"]


def test_the_shipped_eagle_head_against_the_shipped_n4_head():
    """The figures come from the heads' own training histories (0.36 M against 4.81 M as shipped):
    retraining either head moves the note with it."""
    eagle, n4 = REPO_HEADS / "smollm2-135m-eagle", REPO_HEADS / "smollm2-135m-n4"
    if not (eagle / "train_history.json").is_file() or not (n4 / "train_history.json").is_file():
        pytest.skip("the shipped heads are not in this tree")
    last = {d: json.loads((d / "train_history.json").read_text())[-1]["tokens"] for d in (eagle, n4)}
    out = head_budget_note(str(eagle), {"smollm2-135m-n4 PDM head": str(n4)})
    assert out["head_training_source"] == str(eagle / "train_history.json")
    assert (out["head_training_tokens"], out["reference_tokens"]) == (last[eagle], last[n4])
    assert out["under_trained"] == (last[eagle] < last[n4])


def test_bench_puts_the_budget_on_the_eagle_row():
    """`spd bench`'s eagle row, read beside the model's shipped PDM heads and this run's: the
    best-trained one sets the budget, and a model given as a path has no shipped heads to glob."""
    from types import SimpleNamespace

    from spd_engine.tools.bench import eagle_budget, table

    eagle, n2 = REPO_HEADS / "smollm2-135m-eagle", REPO_HEADS / "smollm2-135m-n2"
    if not (eagle / "eagle.json").is_file() or not (n2 / "pdm.json").is_file():
        pytest.skip("the shipped heads are not in this tree")
    tokens = {d.name: training_tokens(d)[0] for d in REPO_HEADS.glob("smollm2-135m-n*")}
    best = max(tokens, key=tokens.__getitem__)
    rows = [{"name": "ar", "mode": "ar"}, {"name": "spd-colocate", "mode": "spd"}, {"name": "eagle", "mode": "eagle"}]
    ecfg = SimpleNamespace(drafting=SimpleNamespace(pdm=str(n2), eagle_head=str(eagle)))
    line = eagle_budget(rows, ecfg, "smollm2-135m")
    budget = rows[2]["head_budget"]
    assert budget["reference"] == f"{best} PDM head" and budget["reference_tokens"] == tokens[best]
    if budget["under_trained"]:
        assert line.startswith("eagle: its head is under-trained") and "train_history.json" in line
        assert rows[2]["note"].startswith("under-trained head")
    _, columns = table(rows)
    assert columns[-1] == ("note", "note", "")
    path_rows = [{"name": "eagle", "mode": "eagle"}]
    eagle_budget(path_rows, ecfg, "/models/some-checkpoint")  # only this run's head (none: no spd row)
    assert path_rows[0]["head_budget"]["reference"] is None
    assert eagle_budget([{"name": "ar", "mode": "ar"}], ecfg, "smollm2-135m") is None

"""The results figure (bench/results_plot.py): reports in the shapes `spd eval --json` and `spd bench
--json` write become bars whose lengths are their values on the drawn axes, the ceiling lands at
its ratio, bad reports are refused naming what is missing, and the file is written whole."""
from __future__ import annotations

import math
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from spd_engine.bench import results_plot as rp
from spd_engine.bench.speedups import add_speedups
from spd_engine.train.eval_records import EvalReport, PromptRecord
from spd_engine.train.replay_records import Acceptance

pytestmark = pytest.mark.pure
SVG = "{http://www.w3.org/2000/svg}"


def eval_report(n: int, tokens: int, ticks: int, sources: dict[str, list[int]], temperature: float = 0.0) -> dict:
    """A one-prompt `spd eval --json` report, built by the code that writes them."""
    acc = Acceptance(n=n, tokens=tokens, ticks=ticks, verified=tokens - 1,
                     accepted=sum(a for _, a in sources.values()), by_source=sources)
    rec = PromptRecord("mt_bench", 0, 1, 5, acc, 1.0, None, None)
    return EvalReport(n, [rec]).to_json({"model": "m", "mode": "spd", "n": n, "temperature": temperature})


def bench_report(rates: dict[str, list[float]], synthetic_alpha: float | None = None) -> dict:
    """An `spd bench --json` report's rows with their ratios, computed by the code that writes them."""
    rows = [{"name": name, "mode": name.split("-")[0], "n": 1 if name == "ar" else 2,
             "decode_tok_s_per_repeat": r} for name, r in rates.items()]
    add_speedups(rows)
    return {"rows": rows, "synthetic_alpha": synthetic_alpha, "model": "m"}


def bars(svg: str) -> dict[str, ET.Element]:
    """The drawn bars (rects with a tooltip) by their tooltip."""
    root = ET.fromstring(svg)
    return {el.find(f"{SVG}title").text: el for el in root.iter(f"{SVG}rect") if el.find(f"{SVG}title") is not None}


def f(el: ET.Element, key: str) -> float:
    return float(el.get(key))


def test_eal_bars_stand_on_the_axis_in_n_order_with_heights_in_proportion():
    reports = [("a", eval_report(n, 101, ticks, {"pdm": [60, 30], "suffix": [40, 30]}))
               for n, ticks in ((4, 80), (2, 90), (8, 100))]
    reports.append(("b", eval_report(2, 101, 150, {"pdm": [100, 40]})))
    data = rp.figure_data(reports)
    eal = {n: n * 100 / t for n, t in ((4, 80), (2, 90), (8, 100))}  # pooled: n * (N - 1) / ticks
    assert data.acceptance == {rp.DEFAULT_DRAFTING: pytest.approx(eal), rp.PDM_ONLY: pytest.approx({2: 200 / 150})}
    drawn = bars(rp.results_svg(data))
    default = {n: drawn[f"n={n}, {rp.DEFAULT_DRAFTING}: EAL {v:.3f}"] for n, v in eal.items()}
    assert all(f(b, "y") + f(b, "height") == pytest.approx(rp.BOTTOM, abs=0.11) for b in default.values())
    per_unit = {n: f(b, "height") / eal[n] for n, b in default.items()}
    assert max(per_unit.values()) - min(per_unit.values()) < 0.1  # heights ~ EAL (0.1 px rounding)
    assert f(default[2], "x") < f(default[4], "x") < f(default[8], "x")
    pdm = drawn[f"n=2, {rp.PDM_ONLY}: EAL {200 / 150:.3f}"]
    assert f(pdm, "height") / (200 / 150) == pytest.approx(per_unit[2], abs=0.1)
    assert f(pdm, "x") != f(default[2], "x")  # beside it, not over it


def test_speed_bars_are_ratios_to_ar_and_the_ceiling_lands_at_its_ratio():
    run = bench_report({"ar": [10.0, 10.0, 10.0], "pp": [8.0, 7.5, 8.5], "spd-colocate": [12.0, 11.0, 12.5]})
    ceiling = bench_report({"ar": [10.0, 10.0], "spd-colocate": [14.0, 15.0]}, synthetic_alpha=1.0)
    data = rp.figure_data([("run", run), ("ceiling", ceiling)])
    assert [(b.label, b.x_ar, b.lo, b.hi) for b in data.speed] == [("pp n=2", 0.8, 0.75, 0.85),
                                                                    ("SPD co-located n=2", 1.2, 1.1, 1.25)]
    assert data.ceiling is not None and data.ceiling.x_ar == pytest.approx(1.45)
    svg = rp.results_svg(data)
    drawn = bars(svg)
    spd, pp = drawn["SPD co-located n=2: 1.20x ar"], drawn["pp n=2: 0.80x ar"]
    assert f(spd, "x") == f(pp, "x") == rp.B_LEFT
    unit = f(spd, "width") / 1.2  # pixels per 1x
    assert f(pp, "width") == pytest.approx(0.8 * unit, abs=0.1)
    assert spd.get("fill") == rp.SPD_FILL and pp.get("fill") == rp.OTHER_FILL
    root = ET.fromstring(svg)
    dashed = [el for el in root.iter(f"{SVG}line") if el.get("stroke-dasharray")]
    assert len(dashed) == 1 and f(dashed[0], "x1") == pytest.approx(rp.B_LEFT + 1.45 * unit, abs=0.2)
    assert "ceiling: SPD co-located n=2, 1.45x ar" in svg


def test_the_drafting_rule_is_the_recorded_setting_else_the_drafts_sources():
    quiet = eval_report(2, 50, 40, {"pdm": [49, 20]})  # no suffix draft happened to match
    assert set(rp.figure_data([("a", quiet)]).acceptance) == {rp.PDM_ONLY}  # an older report: sources decide
    assert set(rp.figure_data([("a", {**quiet, "suffix_drafts": True})]).acceptance) == {rp.DEFAULT_DRAFTING}
    mixed = eval_report(2, 50, 40, {"pdm": [29, 10], "suffix": [20, 10]}, temperature=0.7)
    assert set(rp.figure_data([("a", mixed)]).acceptance) == {rp.DEFAULT_DRAFTING + ", T=0.7"}


def test_the_same_input_draws_the_same_bytes():
    docs = [("a", eval_report(2, 50, 40, {"pdm": [49, 20]})), ("b", bench_report({"ar": [1.0], "pp": [0.9]}))]
    assert rp.results_svg(rp.figure_data(docs)) == rp.results_svg(rp.figure_data(docs))


def test_figure_data_files_give_what_reports_give():
    doc = {"format": rp.FORMAT, "title": "t", "acceptance": [{"rule": rp.DEFAULT_DRAFTING, "eal": {"4": 2.5}}],
           "speed": [{"label": "pp n=2", "x_ar": 0.8, "min": 0.75, "max": 0.85}],
           "ceiling": {"label": "SPD co-located n=2", "x_ar": 1.45, "spd": True}}
    data = rp.figure_data([("file", doc)])
    assert data.acceptance == {rp.DEFAULT_DRAFTING: {4: 2.5}} and data.title == "t"
    assert data.speed == [rp.Bar("pp n=2", 0.8, 0.75, 0.85)]
    assert data.ceiling == rp.Bar("SPD co-located n=2", 1.45, None, None, spd=True)


@pytest.mark.parametrize(("doc", "problem"), [
    ({"n": 2}, "neither an spd eval report"),
    ({"n": 2, "overall": {"eal": 2.0}}, "'by_source'"),
    ({"n": 2, "overall": {"by_source": {}}}, "no number under 'eal'"),
    ({"n": 2, "overall": {"eal": float("nan"), "by_source": {}}}, "no number under 'eal'"),
    ({"overall": {"eal": 2.0, "by_source": {}}}, "no number under 'n'"),
    ({"mode": "eagle", "n": 1, "overall": {"eal": 2.0, "by_source": {}}}, "not SPD's acceptance"),
    ({"rows": "x"}, "no 'rows' list"),
    ({"rows": [{"name": "pp", "speedup_vs_ar": 0.8}]}, "no ar row"),
    ({"rows": [{"name": "ar"}, {"name": "pp"}]}, "row pp has no 'speedup_vs_ar'"),
    ({"rows": [{"name": "ar"}, {"name": "spd", "speedup_vs_ar": 1.1}], "synthetic_alpha": 0.5}, "synthetic"),
    ({"format": rp.FORMAT, "speed": [{"x_ar": 1.0}]}, "no 'label'"),
    ({"format": rp.FORMAT, "acceptance": [{"eal": {"2": 1.5}}]}, "needs 'rule' and 'eal'"),
    ({"format": rp.FORMAT, "speed": ["pp"]}, "no 'label'"),
    ({"format": rp.FORMAT, "acceptance": [2.5]}, "needs 'rule' and 'eal'"),
    ({"format": rp.FORMAT}, "nothing to draw"),
    ([1, 2], "not a JSON object"),
])
def test_bad_input_is_refused_naming_the_problem(doc, problem):
    with pytest.raises(ValueError, match=problem) as err:
        rp.figure_data([("r.json", doc)])
    assert "r.json" in str(err.value) or problem == "nothing to draw"


def test_two_figures_for_one_bar_are_refused():
    twice = [("a", eval_report(2, 50, 40, {"pdm": [49, 20]})), ("b", eval_report(2, 50, 30, {"pdm": [49, 30]}))]
    with pytest.raises(ValueError, match="second EAL for PDM drafts alone at n=2"):
        rp.figure_data(twice)


def test_load_docs_names_an_unreadable_file(tmp_path: Path):
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ValueError, match="bad.json: cannot read"):
        rp.load_docs([str(tmp_path / "bad.json")])
    with pytest.raises(ValueError, match="missing.json: cannot read"):
        rp.load_docs([str(tmp_path / "missing.json")])


def test_write_svg_replaces_whole_or_not_at_all(tmp_path: Path):
    out = tmp_path / "f.svg"
    rp.write_svg(out, "<svg/>\n")
    assert out.read_text() == "<svg/>\n"
    with pytest.raises(TypeError):
        rp.write_svg(out, 42)  # type: ignore[arg-type]  # fails mid-write
    assert out.read_text() == "<svg/>\n" and [p.name for p in tmp_path.iterdir()] == ["f.svg"]
    with pytest.raises(ValueError, match="cannot write"):
        rp.write_svg(tmp_path / "no" / "f.svg", "<svg/>")


def test_axes_leave_room_above_the_largest_value():
    assert rp._nice_top(2.841, 0.5) == 3.5 and rp._nice_top(1.47, 0.25) == 1.75
    assert math.isclose(rp._nice_top(1.0, 0.25), 1.25)

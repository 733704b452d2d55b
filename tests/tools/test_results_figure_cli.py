"""The results figure from the commands: `spd plan --results-figure` redraws it from saved reports,
`spd eval --plot F.svg` and `spd bench --plot F.svg` draw their own run's bars with the numbers their
--json reports hold, and what cannot be drawn is refused before the run."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from spd_engine.bench.results_plot import DEFAULT_DRAFTING, PDM_ONLY, figure_data, load_docs, results_svg
from spd_engine.tools.cli import main

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--model", "random:tiny-llama", "--threads", "1"]


@pytest.mark.pure
def test_plan_redraws_the_figure_from_saved_reports(tmp_path: Path):
    data = str(ROOT / "docs" / "figures" / "results.json")
    assert main(["plan", "--results-figure", str(tmp_path / "r.svg"), "--results-from", data]) == 0
    assert (tmp_path / "r.svg").read_text() == results_svg(figure_data(load_docs([data])))
    assert main(["plan", "--results-figure", str(tmp_path / "r.svg")]) == 2  # the reports are needed
    assert main(["plan", "--results-figure", str(tmp_path / "x.svg"), "--results-from", str(tmp_path / "no.json")]) == 2
    assert not (tmp_path / "x.svg").exists()


def test_eval_plot_svg_draws_this_runs_eal(tmp_path: Path):
    d = tmp_path / "eval"
    d.mkdir()
    for name in ("mt_bench", "humaneval", "gsm8k"):
        (d / f"{name}.jsonl").write_text(json.dumps({"question_id": 1, "turns": ["Tell me a story."]}) + "\n")
    out, svg = tmp_path / "e.json", tmp_path / "e.svg"
    assert main(["eval", *TINY, "--capacity", "256", "--stages", "2", "--data-dir", str(d), "--max-new-tokens", "12",
                 "--json", str(out), "--plot", str(svg)]) == 0
    eal = json.loads(out.read_text())["overall"]["eal"]
    assert f"n=2, {DEFAULT_DRAFTING}: EAL {eal:.3f}</title>" in svg.read_text()
    assert main(["eval", *TINY, "--capacity", "256", "--stages", "2", "--data-dir", str(d), "--max-new-tokens", "12",
                 "--suffix-drafts", "off", "--plot", str(svg)]) == 0
    assert f"n=2, {PDM_ONLY}: EAL " in svg.read_text() and DEFAULT_DRAFTING not in svg.read_text()
    assert main(["eval", *TINY, "--mode", "eagle", "--data-dir", str(d), "--plot", str(tmp_path / "g.svg")]) == 2


@pytest.mark.multiproc
def test_bench_plot_draws_this_runs_ratios(tmp_path: Path):
    out, svg = tmp_path / "b.json", tmp_path / "b.svg"
    argv = ["bench", *TINY, "--stages", "2", "--prompt", "hello", "--max-new-tokens", "6", "--ignore-eos",
            "--configs", "ar,spd-colocate", "--repeats", "2"]
    assert main([*argv, "--json", str(out), "--plot", str(svg)]) == 0
    row = next(r for r in json.loads(out.read_text())["rows"] if r["name"] == "spd-colocate")
    assert f"SPD co-located n=2: {row['speedup_vs_ar']:.2f}x ar</title>" in svg.read_text()
    assert main([*argv, "--synthetic-alpha", "0.5", "--plot", str(tmp_path / "s.svg")]) == 2  # before the run
    assert main([*argv, "--plot", str(tmp_path / "missing" / "s.svg")]) == 2

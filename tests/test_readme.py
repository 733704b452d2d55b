"""README.md stays a two-minute read: at most 7,000 characters, exactly the two set-up commands
(`make demo`, `make test`, both Makefile targets), and its picture a file the repository tracks."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_short():
    assert len(README) <= 7000, len(README)


def test_two_set_up_commands_that_the_makefile_has():
    setup = README[README.index("## Set-up"):README.index("\n## ", README.index("## Set-up") + 1)]
    commands = re.findall(r"^    (make \S+)", setup, re.M)
    assert commands == ["make demo", "make test"], commands
    makefile = (ROOT / "Makefile").read_text()
    assert all(re.search(rf"^{c.split()[1]}:", makefile, re.M) for c in commands)


def test_its_picture_is_tracked():
    images = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", README)
    assert images, "the README shows the tick schedule"
    tracked = subprocess.run(["git", "ls-files", *images], cwd=ROOT, capture_output=True, text=True).stdout.split()
    assert sorted(tracked) == sorted(images) or not (ROOT / ".git").exists(), (images, tracked)


RESULTS_DATA, RESULTS_SVG = ROOT / "docs" / "figures" / "results.json", ROOT / "docs" / "figures" / "results.svg"


def _results_figure():
    from spd_engine.bench.results_plot import figure_data, load_docs

    return figure_data(load_docs([str(RESULTS_DATA)]))


def test_the_results_figure_is_what_its_data_draws():
    from spd_engine.bench.results_plot import results_svg

    assert "](docs/figures/results.svg)" in README
    assert RESULTS_SVG.read_text() == results_svg(_results_figure()), \
        "redraw it: spd plan --results-figure docs/figures/results.svg --results-from docs/figures/results.json"


def _numbers(text: str) -> list[float]:
    return [float(x) for x in re.findall(r"\d+\.\d+", text)]


def test_the_results_figure_and_the_table_agree():
    """The figure's data are the table's figures: EAL by n (both drafting rules), SPD and pp against
    ar, transformers' rows as SPD's ratio over them, the ceiling."""
    from spd_engine.bench.results_plot import DEFAULT_DRAFTING, PDM_ONLY

    data = _results_figure()
    row = lambda key: next(line for line in README.splitlines() if key in line)  # noqa: E731
    eal = _numbers(row("| acceptance, 120 dev prompts").split("|")[2])
    assert [round(data.acceptance[DEFAULT_DRAFTING][n], 2) for n in (2, 4, 8)] == eal[:3]
    assert [round(data.acceptance[PDM_ONLY][n], 2) for n in (2, 4, 8)] == eal[3:6]
    speed = {b.label: b for b in data.speed}
    spd = speed["SPD co-located n=2"]
    assert _numbers(row("against our own ar on both cores").split("|")[2]) == [spd.x_ar, spd.lo, spd.hi,
                                                                               speed["pp n=2"].x_ar]
    hf = _numbers(row("against transformers on the same 2 cores").split("|")[2])
    assert hf == [round(spd.x_ar / speed[label].x_ar, 2) for label in ("transformers generate",
                                                                         "transformers prompt lookup")]
    assert _numbers(row("| the ceiling").split("|")[2])[0] == data.ceiling.x_ar

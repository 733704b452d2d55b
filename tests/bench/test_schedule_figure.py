"""README.md's picture is what the project draws from the checked tick simulation: the tracked SVG
equals `spd plan --schedule-figure`'s output, and the figure shows the simulation's ticks."""
from __future__ import annotations

from pathlib import Path

import pytest

from spd_engine.bench.schedule_figure import WORKED_EXAMPLE, worked_example_svg
from spd_engine.engine.protocol.schedule import simulate

pytestmark = pytest.mark.pure
FIGURE = Path(__file__).resolve().parents[2] / "docs" / "figures" / "tick-schedule.svg"


def test_the_tracked_figure_is_what_the_simulation_draws():
    assert FIGURE.read_text() == worked_example_svg(), "redraw it: spd plan --schedule-figure docs/figures/tick-schedule.svg"


def test_the_figure_has_a_row_per_tick_and_the_rejection():
    svg = worked_example_svg()
    records = simulate(WORKED_EXAMPLE["n"], WORKED_EXAMPLE["verdicts"], WORKED_EXAMPLE["max_tokens"])
    assert all(f">{r.tick}</text>" in svg for r in records)
    assert svg.count("accepted: commit") == sum(r.verify is not None and r.verify.accepted for r in records) == 4
    assert svg.count("rejected: commit") == 1 and "refilling after the flush" in svg


def test_the_cli_writes_it(tmp_path: Path):
    from spd_engine.tools.cli import main

    assert main(["plan", "--schedule-figure", str(tmp_path / "f.svg")]) == 0
    assert (tmp_path / "f.svg").read_text() == worked_example_svg()

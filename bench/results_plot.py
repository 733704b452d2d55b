"""The results figure: (a) acceptance, the pooled EAL at each stage count n per drafting rule, and
(b) the speed rows of a same-run benchmark as ratios to ar, with the ceiling (every draft right,
one token per tick) when a `--synthetic-alpha 1.0` run is among the inputs.

Inputs are `spd eval --json` and `spd bench --json` reports, or a figure-data file (FORMAT below:
the same figures with the page each comes from, as docs/figures/results.json holds the README
table's). Plain SVG text like schedule_figure.py, no plotting library: the same input gives the
same bytes, so the tracked figure is checked against what this draws.
"""
from __future__ import annotations

import json
import math
import os
import tempfile
from dataclasses import dataclass, field
from html import escape
from pathlib import Path

FORMAT = "spd-results/1"
DEFAULT_DRAFTING, PDM_ONLY = "default drafting", "PDM drafts alone"
# bench config -> the row's label in the figure (other configs keep their name)
LABELS = {"spd": "SPD", "spd-colocate": "SPD co-located", "spd-colocate-1": "SPD co-located, no runs",
          "pp": "pp", "tp": "tp", "eagle": "eagle", "hf": "transformers generate",
          "hf-lookup": "transformers prompt lookup"}
SERIES_FILL = ("#3182bd", "#9ecae1", "#31a354", "#a1d99b")  # one per drafting rule, in order of appearance
SPD_FILL, OTHER_FILL, CEILING = "#3182bd", "#bdbdbd", "#e6550d"

W, H, TOP, BOTTOM = 860, 340, 74, 280  # canvas; the panels' plot area runs from TOP to BOTTOM
A_LEFT, A_RIGHT = 52, 330  # panel (a)'s plot area, x
B_LEFT, B_RIGHT = 560, 830  # panel (b)'s plot area, x (row labels to the left of B_LEFT)


@dataclass(frozen=True)
class Bar:
    """One speed row: its ratio to ar (median over repeats) and the min-max of the per-repeat ratios."""
    label: str
    x_ar: float
    lo: float | None = None
    hi: float | None = None
    spd: bool = False  # drawn in SPD's colour


@dataclass
class FigureData:
    title: str = ""
    acceptance: dict[str, dict[int, float]] = field(default_factory=dict)  # drafting rule -> n -> pooled EAL
    speed: list[Bar] = field(default_factory=list)
    ceiling: Bar | None = None


def _number(doc: dict, key: str, where: str) -> float:
    value = doc.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{where}: no number under {key!r} (got {value!r})")
    return float(value)


def _add_eal(data: FigureData, rule: str, n: int, eal: float, where: str) -> None:
    series = data.acceptance.setdefault(rule, {})
    if n in series:
        raise ValueError(f"{where}: a second EAL for {rule} at n={n}")
    series[n] = eal


def add_eval_report(data: FigureData, report: dict, where: str) -> None:
    """One `spd eval --json` report: its pooled EAL at its n, under its drafting rule: PDM drafts alone
    with --suffix-drafts off, else the default (a report without `suffix_drafts`: the default when
    any draft came from another source than the PDM)."""
    if report.get("mode", "spd") != "spd":
        raise ValueError(f"{where}: a {report['mode']} evaluation, not SPD's acceptance")
    overall = report.get("overall")
    if not isinstance(overall, dict) or not isinstance(overall.get("by_source"), dict):
        raise ValueError(f"{where}: no 'overall' summary with 'by_source' (an spd eval --json report has both)")
    n = int(_number(report, "n", where))
    suffix = report.get("suffix_drafts")  # None in older reports: then the drafts' sources decide
    rule = DEFAULT_DRAFTING if (suffix if suffix is not None else set(overall["by_source"]) - {"pdm"}) else PDM_ONLY
    if report.get("temperature"):
        rule += f", T={report['temperature']:g}"
    _add_eal(data, rule, n, _number(overall, "eal", f"{where} overall"), where)
    data.title = data.title or str(report.get("model") or "")


def _bar(row: dict, where: str, n: int | None) -> Bar:
    name = row.get("name")
    if not isinstance(name, str):
        raise ValueError(f"{where}: a row without a 'name'")
    if row.get("speedup_vs_ar") is None:
        raise ValueError(f"{where}: row {name} has no 'speedup_vs_ar' (the run needs its ar row)")
    label = LABELS.get(name, name) + (f" n={n}" if n and n > 1 else "")
    median = _number(row, "speedup_vs_ar", f"{where} row {name}")
    lo, hi = row.get("speedup_vs_ar_min"), row.get("speedup_vs_ar_max")
    spread = (None, None) if lo is None or hi is None else (float(lo), float(hi))
    return Bar(label, median, *spread, spd=row.get("mode") == "spd" or name.startswith("spd"))


def add_bench_report(data: FigureData, report: dict, where: str) -> None:
    """One `spd bench --json` report: every row but ar against ar; a `--synthetic-alpha 1.0` run
    gives the ceiling (its SPD row) instead."""
    rows = report.get("rows")
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise ValueError(f"{where}: no 'rows' list (an spd bench --json report has one)")
    if not any(r.get("name") == "ar" for r in rows):
        raise ValueError(f"{where}: no ar row; the speed panel is ratios to ar")
    others = [r for r in rows if r.get("name") != "ar"]
    alpha = report.get("synthetic_alpha")
    if alpha is not None:
        spd = [r for r in others if str(r.get("name", "")).startswith("spd")]
        if alpha != 1.0 or not spd:
            raise ValueError(f"{where}: synthetic acceptance {alpha}: only a --synthetic-alpha 1.0 run with an "
                             "SPD row (the ceiling) belongs in the figure")
        if data.ceiling is not None:
            raise ValueError(f"{where}: a second ceiling run")
        data.ceiling = _bar(spd[0], where, spd[0].get("n"))
        return
    data.speed += [_bar(r, where, r.get("n")) for r in others]
    data.title = data.title or str(report.get("model") or "")


def add_figure_data(data: FigureData, doc: dict, where: str) -> None:
    """A figure-data file: {"format", "title", "acceptance": [{"rule", "eal": {n: EAL}}],
    "speed": [{"label", "x_ar", "min", "max", "spd"}], "ceiling": {...} or null}; "source" keys
    (the page a figure comes from) are for the reader."""
    for i, series in enumerate(doc.get("acceptance") or []):
        if not isinstance(series, dict) or not isinstance(series.get("rule"), str) \
                or not isinstance(series.get("eal"), dict):
            raise ValueError(f"{where}: acceptance[{i}] needs 'rule' and 'eal' ({{n: EAL}})")
        for n, eal in series["eal"].items():
            _add_eal(data, series["rule"], int(n), _number(series["eal"], n, f"{where} acceptance[{i}]"), where)
    speed = [("speed", i, row) for i, row in enumerate(doc.get("speed") or [])]
    for key, i, row in speed + ([("ceiling", 0, doc["ceiling"])] if doc.get("ceiling") else []):
        at = f"{where} {key}[{i}]"
        if not isinstance(row, dict) or not isinstance(row.get("label"), str):
            raise ValueError(f"{at}: no 'label'")
        spread = [None if row.get(k) is None else _number(row, k, at) for k in ("min", "max")]
        bar = Bar(row["label"], _number(row, "x_ar", at), *spread, spd=bool(row.get("spd")))
        if key == "ceiling":
            data.ceiling = bar
        else:
            data.speed.append(bar)
    data.title = data.title or str(doc.get("title") or "")


def figure_data(docs: list[tuple[str, dict]]) -> FigureData:
    """The figure's data from (name, parsed JSON) pairs: eval reports, bench reports, figure-data files."""
    data = FigureData()
    for where, doc in docs:
        if not isinstance(doc, dict):
            raise ValueError(f"{where}: not a JSON object")
        if doc.get("format") == FORMAT:
            add_figure_data(data, doc, where)
        elif "rows" in doc:
            add_bench_report(data, doc, where)
        elif "overall" in doc:
            add_eval_report(data, doc, where)
        else:
            raise ValueError(f"{where}: neither an spd eval report ('overall'), an spd bench report ('rows') nor "
                             f"figure data (format {FORMAT})")
    if not data.acceptance and not data.speed and data.ceiling is None:
        raise ValueError("nothing to draw: no EAL from an eval report and no speed row from a bench report")
    return data


def load_docs(paths: list[str]) -> list[tuple[str, dict]]:
    """Read the JSON files; a missing or malformed one is a ValueError naming it."""
    out = []
    for p in paths:
        try:
            out.append((p, json.loads(Path(p).read_text())))
        except (OSError, ValueError) as err:
            raise ValueError(f"{p}: cannot read a JSON report ({err})") from None
    return out


def _nice_top(value: float, step: float) -> float:
    """The axis end: `value` plus room for its label, rounded up to a whole `step`."""
    return step * math.ceil((value * 1.08 + 1e-9) / step)


def _text(x: float, y: float, text: str, anchor: str = "middle", extra: str = "") -> str:
    return f'<text x="{x:.1f}" y="{y:.1f}" text-anchor="{anchor}"{extra}>{escape(text)}</text>'


def acceptance_panel(acceptance: dict[str, dict[int, float]]) -> list[str]:
    """Panel (a): grouped bars, one group per n, one bar per drafting rule; y is EAL from 0."""
    ns = sorted({n for series in acceptance.values() for n in series})
    top = _nice_top(max(v for series in acceptance.values() for v in series.values()), 0.5)
    y = lambda v: BOTTOM - (BOTTOM - TOP) * v / top  # noqa: E731
    out = [_text((A_LEFT + A_RIGHT) / 2, TOP - 30, "(a) acceptance: EAL by stage count n", extra=' font-weight="bold"')]
    for k in range(int(round(top / 0.5)) + 1):
        v = k * 0.5
        out.append(f'<line x1="{A_LEFT}" y1="{y(v):.1f}" x2="{A_RIGHT}" y2="{y(v):.1f}" stroke="#e0e0e0"/>')
        out.append(_text(A_LEFT - 6, y(v) + 4, f"{v:g}", "end"))
    group = (A_RIGHT - A_LEFT) / len(ns)
    bar_w = min(28.0, group * 0.8 / len(acceptance))
    for i, n in enumerate(ns):
        centre = A_LEFT + group * (i + 0.5)
        out.append(_text(centre, BOTTOM + 16, f"n = {n}"))
        for j, (rule, series) in enumerate(acceptance.items()):
            if n not in series:
                continue
            x = centre + bar_w * (j - len(acceptance) / 2)
            v = series[n]
            out.append(f'<rect x="{x:.1f}" y="{y(v):.1f}" width="{bar_w:.1f}" height="{y(0) - y(v):.1f}" '
                       f'fill="{SERIES_FILL[j % len(SERIES_FILL)]}"><title>{escape(f"n={n}, {rule}: EAL {v:.3f}")}'
                       f'</title></rect>')
            out.append(_text(x + bar_w / 2, y(v) - 4, f"{v:.2f}", extra=' font-size="11"'))
    out.append(f'<line x1="{A_LEFT}" y1="{BOTTOM}" x2="{A_RIGHT}" y2="{BOTTOM}" stroke="#666"/>')
    x = A_LEFT
    for j, rule in enumerate(acceptance):
        out.append(f'<rect x="{x}" y="{BOTTOM + 30}" width="12" height="12" fill="{SERIES_FILL[j % len(SERIES_FILL)]}"/>'
                   + _text(x + 16, BOTTOM + 40, rule, "start"))
        x += 36 + 7 * len(rule)
    return out


def speed_panel(speed: list[Bar], ceiling: Bar | None) -> list[str]:
    """Panel (b): one horizontal bar per row, its ratio to ar with the min-max whisker; ar at 1; the
    ceiling as a dashed line."""
    ends = [b.hi if b.hi is not None else b.x_ar for b in speed] + ([ceiling.x_ar] if ceiling else [])
    right = _nice_top(max(ends + [1.0]), 0.25)
    x = lambda v: B_LEFT + (B_RIGHT - B_LEFT) * v / right  # noqa: E731
    out = [_text((B_LEFT + B_RIGHT) / 2 - 110, TOP - 30, "(b) speed: tok/s over ar's in the same run (min-max)",
                 extra=' font-weight="bold"')]
    for k in range(int(round(right / 0.25)) + 1):
        v = k * 0.25
        out.append(f'<line x1="{x(v):.1f}" y1="{TOP}" x2="{x(v):.1f}" y2="{BOTTOM}" stroke="#e0e0e0"/>')
        if k % 2 == 0:  # a label every 0.5: the 0.25 steps' labels would touch
            out.append(_text(x(v), BOTTOM + 16, f"{v:g}x"))
    row_h = (BOTTOM - TOP) / max(len(speed), 1)
    bar_h = min(24.0, row_h * 0.6)
    for i, b in enumerate(speed):
        mid = TOP + row_h * (i + 0.5)
        out.append(_text(B_LEFT - 8, mid + 4, b.label, "end"))
        out.append(f'<rect x="{B_LEFT}" y="{mid - bar_h / 2:.1f}" width="{x(b.x_ar) - B_LEFT:.1f}" height="{bar_h:.1f}" '
                   f'fill="{SPD_FILL if b.spd else OTHER_FILL}"><title>{escape(f"{b.label}: {b.x_ar:.2f}x ar")}'
                   f'</title></rect>')
        if b.lo is not None and b.hi is not None and b.hi > b.lo:
            lo, hi, cap = x(b.lo), x(b.hi), bar_h / 4
            out.append(f'<path d="M{lo:.1f},{mid - cap:.1f}V{mid + cap:.1f}M{lo:.1f},{mid:.1f}H{hi:.1f}'
                       f'M{hi:.1f},{mid - cap:.1f}V{mid + cap:.1f}" stroke="#333" fill="none"/>')
        end = x(b.hi if b.hi is not None else b.x_ar)
        out.append(_text(end + 4, mid + 4, f"{b.x_ar:.2f}x", "start", ' font-size="11"'))
    out.append(f'<line x1="{x(1):.1f}" y1="{TOP - 4}" x2="{x(1):.1f}" y2="{BOTTOM}" stroke="#333"/>')
    out.append(_text(x(1), TOP - 7, "ar", extra=' font-size="11"'))
    if ceiling is not None:
        c = x(ceiling.x_ar)
        out.append(f'<line x1="{c:.1f}" y1="{TOP - 4}" x2="{c:.1f}" y2="{BOTTOM}" stroke="{CEILING}" '
                   f'stroke-width="2" stroke-dasharray="6,4"><title>{escape(f"{ceiling.label}: {ceiling.x_ar:.2f}x ar")}'
                   f'</title></line>')
        out.append(_text(c, TOP - 7, "ceiling", extra=f' font-size="11" fill="{CEILING}"'))
        out.append(_text(B_RIGHT, BOTTOM + 40, f"ceiling: {ceiling.label}, {ceiling.x_ar:.2f}x ar", "end",
                         f' fill="{CEILING}"'))
    out.append(f'<line x1="{B_LEFT}" y1="{TOP}" x2="{B_LEFT}" y2="{BOTTOM}" stroke="#666"/>')
    return out


def results_svg(data: FigureData) -> str:
    """The figure: panel (a) when there is acceptance, panel (b) when there are speed rows or a ceiling."""
    if not data.acceptance and not data.speed and data.ceiling is None:
        raise ValueError("nothing to draw: no acceptance, no speed rows and no ceiling")
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" '
           f'font-family="Helvetica, Arial, sans-serif" font-size="12">',
           f'<rect width="{W}" height="{H}" fill="white"/>',
           _text(10, 22, data.title or "results", "start", ' font-size="15" font-weight="bold"')]
    if data.acceptance:
        out += acceptance_panel(data.acceptance)
    if data.speed or data.ceiling is not None:
        out += speed_panel(data.speed, data.ceiling)
    out.append("</svg>")
    return "\n".join(out) + "\n"


def write_svg(path: str | Path, text: str) -> None:
    """Write `text` to `path` whole or not at all: a temporary sibling renamed into place."""
    path = Path(path)
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".partial")
    except OSError as err:  # a missing or read-only directory: the user's to fix, one line
        raise ValueError(f"cannot write {path}: {err.strerror} ({path.parent})") from None
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes the file private; a plain write would not
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def plot_results(paths: list[str], out: str | Path) -> FigureData:
    """Read the reports at `paths`, draw the figure to `out`; returns what was drawn."""
    data = figure_data(load_docs(paths))
    write_svg(out, results_svg(data))
    return data

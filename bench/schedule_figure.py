"""The tick schedule as a picture: which stage holds which token each tick, drafts verified and one
rejected, drawn as SVG from the checked simulation (engine/protocol/schedule.py `simulate`, the
worked example of docs/design.md 3.3). Plain SVG text, no plotting library: the same input gives
the same bytes, so the tracked figure is checked against what this draws."""
from __future__ import annotations

from html import escape

from spd_engine.engine.protocol.schedule import CORRECTION, DRAFT, FIRST, STALE, TickRecord, Token, position_label, simulate

CELL_W, CELL_H, PAD = 78, 30, 10
COLOURS = {FIRST: "#9ecae1", DRAFT: "#c7e9c0", CORRECTION: "#fdd0a2", STALE: "#e0e0e0"}
REJECTED = "#fc9272"


def _label(token: Token) -> str:
    pos = position_label(token.position)
    if token.kind == FIRST:
        return f"x {pos}"
    if token.kind == CORRECTION:
        return f"fix {pos}"
    if token.kind == STALE:
        return "stale"
    return f"d{chr(39) * token.epoch} {pos}"


def _cell(x: int, y: int, w: int, text: str, fill: str, bold: bool = False) -> str:
    weight = ' font-weight="bold"' if bold else ""
    return (f'<rect x="{x}" y="{y}" width="{w}" height="{CELL_H}" fill="{fill}" stroke="#666"/>'
            f'<text x="{x + w / 2:g}" y="{y + CELL_H / 2 + 5:g}" text-anchor="middle"{weight}>{escape(text)}</text>')


def schedule_svg(records: list[TickRecord], title: str) -> str:
    """One row per tick: the token each stage computes, then the verification and what it commits."""
    n = len(records[0].stages)
    verify_w = 3 * CELL_W
    width = PAD * 2 + CELL_W * (n + 1) + verify_w
    height = PAD * 2 + CELL_H * (len(records) + 2) + 20
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'font-family="Helvetica, Arial, sans-serif" font-size="13">',
           f'<rect width="{width}" height="{height}" fill="white"/>',
           f'<text x="{PAD}" y="{PAD + 14}" font-size="15" font-weight="bold">{escape(title)}</text>']
    y = PAD + 24
    header = ["tick"] + [f"stage {p}" for p in range(n)]
    for i, text in enumerate(header):
        out.append(_cell(PAD + i * CELL_W, y, CELL_W, text, "#f7f7f7", bold=True))
    out.append(_cell(PAD + len(header) * CELL_W, y, verify_w, "leaving the last stage: verify", "#f7f7f7", bold=True))
    for record in records:
        y += CELL_H
        out.append(_cell(PAD, y, CELL_W, str(record.tick), "#f7f7f7"))
        for p, token in enumerate(record.stages):
            fill = "white" if token is None else COLOURS[token.kind]
            if token is not None and record.verify is not None and not record.verify.accepted \
                    and token.kind == DRAFT and token == record.verify.draft:
                fill = REJECTED
            out.append(_cell(PAD + (p + 1) * CELL_W, y, CELL_W, "" if token is None else _label(token), fill))
        v = record.verify
        if v is None:
            text, fill = "filling the pipeline" if record.tick < n else "refilling after the flush", "white"
        elif v.accepted:
            text, fill = f"{_label(v.draft)} accepted: commit", COLOURS[DRAFT]
        else:
            text, fill = f"{_label(v.draft)} rejected: commit {_label(record.committed)}, flush", REJECTED
        out.append(_cell(PAD + (n + 1) * CELL_W, y, verify_w, text, fill))
    legend = [("first token", COLOURS[FIRST]), ("draft", COLOURS[DRAFT]), ("rejected draft", REJECTED),
              ("correction", COLOURS[CORRECTION]), ("stale (flushed)", COLOURS[STALE])]
    x, y = PAD, y + CELL_H + 8
    for text, fill in legend:
        out.append(f'<rect x="{x}" y="{y}" width="14" height="14" fill="{fill}" stroke="#666"/>'
                   f'<text x="{x + 18}" y="{y + 12}">{escape(text)}</text>')
        x += 30 + 8 * len(text)
    out.append("</svg>")
    return "\n".join(out) + "\n"


WORKED_EXAMPLE = dict(n=4, verdicts=(True, True, False, True, True), max_tokens=6)  # docs/design.md 3.3


def worked_example_svg() -> str:
    """The figure README.md shows (docs/figures/tick-schedule.svg): n = 4, two drafts accepted, one
    rejected, the refill, two more accepted."""
    records = simulate(WORKED_EXAMPLE["n"], WORKED_EXAMPLE["verdicts"], WORKED_EXAMPLE["max_tokens"])
    return schedule_svg(records, "SPD at n = 4: a token enters stage 0 every tick; the draft behind the "
                                 "token leaving stage 3 is verified")

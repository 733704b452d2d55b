"""Tick timeline: one lane per rank over a few ticks, compute vs receive wait vs driver work.

Input is a traced GenerationResult.trace: driver events (tick, what, t0, t1) and per-stage
(receive start, compute start, compute end) triples, all perf_counter seconds, which share
one clock across the processes of a host.
"""
from __future__ import annotations

COLORS = {"compute": "tab:blue", "wait": "tab:gray", "pdm": "tab:orange", "verify": "tab:red",
          "send": "tab:green", "stage0": "tab:cyan"}


def lanes(trace: dict, first_tick: int, ticks: int) -> tuple[list[str], list[list[tuple[str, float, float]]]]:
    """(lane names, per-lane (kind, start, end) segments) for ticks [first_tick, first_tick + ticks)."""
    drv = [e for e in trace["driver"] if first_tick <= e[0] < first_tick + ticks]
    if not drv:
        raise ValueError(f"trace has no driver events in ticks {first_tick}..{first_tick + ticks - 1}")
    t_lo, t_hi = min(e[2] for e in drv), max(e[3] for e in drv)
    names, out = ["driver"], [[(what, t0, t1) for _, what, t0, t1 in drv]]
    for s, triples in enumerate(trace["stages"]):
        segs = []
        for r0, c0, c1 in triples:
            if c1 < t_lo or r0 > t_hi:
                continue
            segs += [("wait", r0, c0), ("compute", c0, c1)]
        names.append(f"stage {s}")
        out.append(segs)
    return names, out


def plot_timeline(trace: dict, path: str, title: str, first_tick: int = 10, ticks: int = 4) -> bool:
    """Write a PNG; False (nothing written) without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    max_tick = max(e[0] for e in trace["driver"])
    first_tick = max(1, min(first_tick, max_tick - ticks + 1))
    names, segs = lanes(trace, first_tick, ticks)
    t_ref = min(t0 for lane in segs for _, t0, _ in lane)
    fig, ax = plt.subplots(figsize=(12, 1 + 0.6 * len(names)))
    for y, lane in enumerate(segs):
        for kind, t0, t1 in lane:
            ax.barh(y, 1e3 * (t1 - t0), left=1e3 * (t0 - t_ref), color=COLORS[kind], height=0.6)
    ax.set_yticks(range(len(names)), names)
    ax.invert_yaxis()
    ax.set_xlabel("ms")
    ax.set_title(title)
    ax.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=c) for c in COLORS.values()], labels=list(COLORS),
              loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True

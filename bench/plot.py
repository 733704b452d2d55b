"""Rendering of a netbench report: nccl-tests-like text tables, CSV, and a PNG plot of P2P
latency and bandwidth against message size per pair and all-reduce latency per group size
(matplotlib is optional)."""
from __future__ import annotations

import csv
import json
import os

from spd_engine.bench.interconnect import NCCL_NOTE, TIME_DEFINITIONS
from spd_engine.bench.stats import format_table, human_bytes


def plot_netbench(report: dict, path: str) -> bool:
    """Write the plot to `path`; returns False (and writes nothing) without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    fig, (ax_lat, ax_bw, ax_ar) = plt.subplots(1, 3, figsize=(15, 4.5))
    pairs = sorted({(r["src"], r["dst"]) for r in report["p2p"]})
    for a, b in pairs:
        rows = sorted((r for r in report["p2p"] if (r["src"], r["dst"]) == (a, b)), key=lambda r: r["bytes"])
        sizes = [r["bytes"] for r in rows]
        ax_lat.plot(sizes, [r["p50_us"] for r in rows], marker="o", label=f"{a}-{b} p50")
        ax_lat.fill_between(sizes, [r["p50_us"] for r in rows], [r["p99_us"] for r in rows], alpha=0.2)
        ax_bw.plot(sizes, [r["bw_GBps"] for r in rows], marker="o", label=f"{a}-{b}")
    groups = sorted({r["ranks"] for r in report.get("allreduce") or []})
    for g in groups:
        rows = sorted((r for r in report["allreduce"] if r["ranks"] == g), key=lambda r: r["bytes"])
        ax_ar.plot([r["bytes"] for r in rows], [r["p50_us"] for r in rows], marker="o", label=f"{g} ranks p50")
    titles = ("P2P one-way latency (band: p50..p99)", "P2P bandwidth = bytes / p50", "all-reduce latency")
    ylabels = ("microseconds", "GB/s", "microseconds")
    for ax, title, ylabel in zip((ax_lat, ax_bw, ax_ar), titles, ylabels):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("message bytes")
        ax.set_ylabel(ylabel)
        ax.set_title(title, fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.suptitle(f"spd netbench: {report['backend']}, {report['world_size']} ranks"
                 + ("  (NCCL path untested)" if report["backend"] == "nccl" else ""))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def format_report(report: dict) -> str:
    """nccl-tests-like text tables of a netbench report."""
    nodes = len({r["node_rank"] for r in report["ranks"]})
    lines = [f"# spd netbench: backend {report['backend']}, {report['world_size']} ranks on {nodes} node(s)"]
    if report.get("link_delay_us"):
        lines.append(f"# EMULATED LINK LATENCY: {report['link_delay_us']:g} us per message added to the runtime's "
                     f"transport rows and per step to the tp all-reduce (--link-delay-us)")
    if report["backend"] == "nccl":
        lines.append(f"# WARNING: {NCCL_NOTE}")
    lat = [("p50_us", "p50(us)", ".1f"), ("p90_us", "p90(us)", ".1f"), ("p99_us", "p99(us)", ".1f"),
           ("max_us", "max(us)", ".1f"), ("jitter_us", "jitter(us)", ".1f")]
    if report["p2p"]:
        lines += ["", "# P2P ping-pong: " + TIME_DEFINITIONS["p2p"], "# " + TIME_DEFINITIONS["busbw"]]
        rows = [{**r, "size": human_bytes(r["bytes"])} for r in report["p2p"]]
        lines.append(format_table(rows, [("src", "src", ""), ("dst", "dst", ""), ("size", "size", ""),
                                         ("iters", "iters", "")] + lat + [("algbw_GBps", "algbw(GB/s)", ".3f"),
                                                                          ("busbw_GBps", "busbw(GB/s)", ".3f"),
                                                                          ("stream_us", "stream(us)", ".1f"),
                                                                          ("idle_p50_us", "idle p50(us)", ".1f"),
                                                                          ("idle_mean_us", "idle mean(us)", ".1f"),
                                                                          ("late_mean_us", "late mean(us)", ".1f")]))
    if report.get("allreduce"):
        lines += ["", "# all-reduce: " + TIME_DEFINITIONS["allreduce"]]
        rows = [{**r, "size": human_bytes(r["bytes"])} for r in report["allreduce"]]
        lines.append(format_table(rows, [("ranks", "ranks", ""), ("size", "size", ""), ("iters", "iters", "")] + lat
                                  + [("algbw_GBps", "algbw(GB/s)", ".3f"), ("busbw_GBps", "busbw(GB/s)", ".3f")]))
    if report["fanin"]:
        lines += ["", "# fan-in to rank 0: " + TIME_DEFINITIONS["fanin"]]
        rows = [{**r, "shape": f"[{r['rows']},{r['hidden']}]"} for r in report["fanin"]]
        lines.append(format_table(rows, [("senders", "senders", ""), ("shape", "shape", ""), ("bytes", "bytes", ""),
                                         ("iters", "iters", "")] + lat + [("bw_GBps", "bw(GB/s)", ".3f")]))
    if report.get("transport"):
        lines += ["", "# the runtime's transport: " + TIME_DEFINITIONS["transport"]]
        rows = [{**r, "size": human_bytes(r["bytes"])} for r in report["transport"]]
        lines.append(format_table(rows, [("transport", "transport", ""), ("a", "src", ""), ("b", "dst", ""),
                                         ("size", "size", ""), ("busy_us", "busy(us)", ".0f"),
                                         ("busy_mb", "busy(MiB)", ".0f"),
                                         ("iters", "iters", "")] + lat + [("mean_us", "mean(us)", ".1f")]))
    if report.get("tick_replay"):
        lines += ["", "# SPD tick replay (sleeping stages): tick = wall / ticks; overhead = tick - slowest stage"]
        rows = [{**r, "stages": ",".join(f"{c:g}" for c in r["stage_ms"]),
                 "layout": "coloc" if r["colocate"] else "sep"} for r in report["tick_replay"]]
        lines.append(format_table(rows, [
            ("n", "n", ""), ("layout", "layout", ""), ("stages", "stage ms", ""), ("pdm_ms", "pdm", ".2f"),
            ("verify_ms", "verify", ".2f"), ("alpha", "alpha", ".2f"), ("ticks", "ticks", ""),
            ("eal", "EAL", ".2f"), ("tick_ms", "tick(ms)", ".3f"), ("overhead_ms", "overhead(ms)", ".3f"),
            ("overhead_pct", "overhead(%)", ".1f"), ("decode_tok_s", "tok/s", ".1f")]))
    return "\n".join(lines)


CSV_FIELDS = ["kind", "src", "dst", "ranks", "senders", "bytes", "iters", "min_us", "p50_us", "p90_us",
              "p99_us", "max_us", "mean_us", "std_us", "jitter_us", "bw_GBps", "algbw_GBps", "busbw_GBps", "post_us",
              "post_mean_us", "stream_us",
              "idle_p50_us", "idle_mean_us", "idle_p99_us", "idle_post_mean_us", "late_p50_us", "late_mean_us"]


def write_outputs(report: dict, json_path: str | None, csv_path: str | None) -> None:
    if json_path:
        os.makedirs(os.path.dirname(os.path.abspath(json_path)), exist_ok=True)
        with open(json_path, "w") as f:
            json.dump(report, f, indent=1)
    if csv_path:
        os.makedirs(os.path.dirname(os.path.abspath(csv_path)), exist_ok=True)
        with open(csv_path, "w", newline="") as f:
            writer = csv.DictWriter(f, CSV_FIELDS, extrasaction="ignore")
            writer.writeheader()
            for kind in ("p2p", "allreduce", "fanin"):
                for row in report.get(kind) or []:
                    writer.writerow({"kind": kind, **row})


def _pyplot():
    """pyplot on the Agg backend (files only, no display); ModuleNotFoundError without matplotlib,
    which the CLI turns into the extra to install."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _smooth(values: list[float], window: int) -> list[float]:
    """Trailing mean over `window` points: one step's loss is noisy, the trend is what a reader wants."""
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out


def plot_training(history: list[dict], path: str, title: str = "spd train") -> None:
    """Loss and, where the run records it, acceptance (top-1 agreement of the draft with the target)
    against training tokens, from a run's history.json (one record per step)."""
    if not history:
        raise ValueError("the run's history is empty: no step to plot")
    plt = _pyplot()
    tokens = [r["tokens"] / 1e6 for r in history]
    window = max(1, len(history) // 50)
    has_agree = any("agree" in r for r in history)
    fig, axes = plt.subplots(1, 2 if has_agree else 1, figsize=(12 if has_agree else 6.5, 4.5), squeeze=False)
    ax = axes[0][0]
    loss = [r["loss"] for r in history]
    ax.plot(tokens, loss, color="tab:blue", alpha=0.25, lw=0.8, label="per step")
    ax.plot(tokens, _smooth(loss, window), color="tab:blue", lw=1.8, label=f"mean of {window} steps")
    ax.set_xlabel("training tokens (millions)")
    ax.set_ylabel("loss")
    ax.set_title("loss")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    if has_agree:
        ax = axes[0][1]
        fills = sorted({r["fill"] for r in history if "fill" in r})
        depth = max((len(r["agree"]) for r in history if isinstance(r.get("agree"), list)), default=0)
        if depth:  # the eagle trainer records one agreement per unrolled draft step
            for i in range(depth):
                rows = [r for r in history if isinstance(r.get("agree"), list) and len(r["agree"]) > i]
                ax.plot([r["tokens"] / 1e6 for r in rows], _smooth([r["agree"][i] for r in rows], window),
                        lw=1.4, label=f"draft step {i}")
        elif len(fills) > 1:  # the PDM trainer draws a fill per step: one curve per fill
            for f in fills:
                rows = [r for r in history if r.get("fill") == f and "agree" in r]
                w = max(1, len(rows) // 30)
                ax.plot([r["tokens"] / 1e6 for r in rows], _smooth([r["agree"] for r in rows], w),
                        lw=1.4, label=f"fill {f}")
        else:
            rows = [r for r in history if "agree" in r]
            ax.plot([r["tokens"] / 1e6 for r in rows], _smooth([r["agree"] for r in rows], window),
                    lw=1.6, color="tab:green", label=f"mean of {window} steps")
        ax.set_xlabel("training tokens (millions)")
        ax.set_ylabel("top-1 agreement with the target")
        ax.set_ylim(0, 1)
        ax.set_title("acceptance (training-time agreement)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{title}: {len(history)} steps, {history[-1]['tokens'] / 1e6:.3f}M tokens")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_eval(report: dict, path: str) -> None:
    """alpha by fill (overall and per dataset), alpha by dataset, and drafts by source (how many were
    verified, and their alpha), from `spd eval`'s report (EvalReport.to_json)."""
    plt = _pyplot()
    overall = report["overall"]
    datasets = report.get("datasets") or {}
    fig, (ax_fill, ax_ds, ax_src) = plt.subplots(1, 3, figsize=(16, 4.5))
    series = [("overall", overall, dict(color="black", lw=2.2))] + [(d, s, dict(lw=1.2)) for d, s in datasets.items()]
    for name, s, style in series:
        by_fill = {int(f): a for f, a in (s.get("alpha_by_fill") or {}).items()}
        if by_fill:
            fills = sorted(by_fill)
            ax_fill.plot(fills, [by_fill[f] for f in fills], marker="o", label=name, **style)
    n = report.get("n")
    if isinstance(n, int):  # fills are whole numbers 1..n
        ax_fill.set_xticks(range(1, n + 1))
    ax_fill.set_xlabel("pipeline fill when the draft was made (n = full)")
    ax_fill.set_ylabel("alpha")
    ax_fill.set_ylim(0, 1.05)
    ax_fill.set_title("alpha by fill")
    names = [*datasets, "overall"]
    alphas = [(datasets[d] if d in datasets else overall).get("alpha") or 0.0 for d in names]
    bars = ax_ds.bar(names, alphas, color=["tab:blue"] * len(datasets) + ["black"])
    ax_ds.bar_label(bars, labels=[f"{a:.3f}" for a in alphas], fontsize=8)
    ax_ds.set_ylim(0, 1.08)  # room for the labels of bars near 1
    ax_ds.set_ylabel("alpha")
    ax_ds.set_title("alpha by dataset")
    sources = sorted((overall.get("by_source") or {}).items())
    if sources:
        bars = ax_src.bar([k for k, _ in sources], [v for _, (v, _acc) in sources], color="tab:orange")
        ax_src.bar_label(bars, labels=[f"alpha {acc / v:.3f}" if v else "-" for _, (v, acc) in sources], fontsize=8)
    else:
        ax_src.text(0.5, 0.5, "no draft sources recorded", ha="center", va="center", transform=ax_src.transAxes)
    ax_src.set_ylabel("verified drafts")
    ax_src.set_title("drafts by source")
    for ax in (ax_fill, ax_ds, ax_src):
        ax.grid(True, axis="y", alpha=0.3)
    if ax_fill.get_legend_handles_labels()[0]:
        ax_fill.legend(fontsize=8)
    spec = report.get("spec") or ""
    fig.suptitle(f"spd eval: n={report.get('n', '?')}, {overall.get('prompts', 0)} prompts"
                 + (f", {spec}" if spec else ""))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

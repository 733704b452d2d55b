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
              "p99_us", "max_us", "mean_us", "std_us", "jitter_us", "bw_GBps", "algbw_GBps", "busbw_GBps", "post_us", "post_mean_us", "stream_us",
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

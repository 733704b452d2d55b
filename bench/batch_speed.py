"""Several requests in the pipeline (docs/design.md 3.12), measured: throughput, per-request latency
and stage utilization against B on one launched runtime (`spd bench --max-batch`, `spd measure
batch-throughput`).

Every request is submitted at the start. Each repeat runs them once one at a time with the
single-request path (`generate`) and once per B with `generate_batch`, in a rotated order per
repeat so drift over the run touches each configuration alike. Reported per configuration:
aggregate tokens/s (median, min-max) and its ratio to one at a time, the median request's time per
output token and time to first token, rows per busy stage step and stage utilization (last repeat),
how many requests gave the one-at-a-time tokens; and per tick: its time, each stage's compute per
step, the driver's PDM time.
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

from spd_engine.engine.protocol.batch_schedule import format_utilization

ONE = "one at a time"


def _one_at_a_time(runtime, reqs) -> dict:
    t0 = time.perf_counter()
    results, ttft, lat = [], [], []
    for r in reqs:
        first: list[float] = []
        res = runtime.generate(r.prompt, r.max_new_tokens, r.eos_ids,
                               on_token=lambda _t, f=first: f.append(time.perf_counter()) if not f else None)
        results.append(res)
        ttft.append(first[0])  # every request arrived at t0 and waited for the ones before it
        lat.append(time.perf_counter())
    wall = time.perf_counter() - t0
    tokens = sum(len(r.tokens) for r in results)
    tpot = [(b - a) / r.decode_tokens for r, a, b in zip(results, ttft, lat) if r.decode_tokens]
    n = len(results[0].stages)
    stage_ms = [1e3 * sum(r.stages[p]["compute_s"] for r in results) /
                max(1.0, sum(r.stages[p]["messages"] for r in results)) for p in range(n)]
    ticks = sum(r.ticks for r in results)
    return dict(tokens_s=tokens / wall, tpot_ms=1e3 * statistics.median(tpot) if tpot else 0.0,
                ttft_s=statistics.median(t - t0 for t in ttft),
                tokens=[r.tokens for r in results], utilization=None, rows_per_step=1.0,
                tick_ms=1e3 * sum(r.decode_s for r in results) / max(1, ticks), stage_ms=stage_ms,
                pdm_ms=1e3 * sum(r.driver["pdm"] for r in results) / max(1, ticks))


def _batched(runtime, reqs, B: int) -> dict:
    out = runtime.generate_batch(reqs, B)
    u = out.utilization
    tpot = [t for t, r in zip(out.tpot_s, out.results) if r.decode_tokens]
    return dict(tokens_s=out.tokens_per_s, tpot_ms=1e3 * statistics.median(tpot) if tpot else 0.0,
                ttft_s=statistics.median(out.ttft_s), tokens=[r.tokens for r in out.results], utilization=u,
                rows_per_step=sum(u.rows) / max(1, sum(u.steps)), tick_ms=1e3 * out.wall_s / max(1, out.ticks),
                stage_ms=[1e3 * st["compute_s"] / max(1.0, st["messages"]) for st in out.stages],
                pdm_ms=1e3 * sum(r.driver["pdm"] for r in out.results) / max(1, out.ticks))


def measure_batches(runtime, reqs: Sequence, batches: Sequence[int], repeats: int,
                    progress: Callable[[str], None] = lambda m: None) -> dict[str, list[dict]]:
    """Configuration name -> one measurement per repeat (ONE first, then `B=b` per b)."""
    if repeats < 1 or not batches or min(batches) < 1:
        raise ValueError("repeats and every B must be >= 1")
    configs = [ONE] + [f"B={b}" for b in batches]
    runs: dict[str, list[dict]] = {c: [] for c in configs}
    _batched(runtime, reqs[:2], 2)  # warm-up: first-use allocations of the slots' caches
    for rep in range(repeats):
        for c in configs[rep % len(configs):] + configs[:rep % len(configs)]:
            runs[c].append(_one_at_a_time(runtime, reqs) if c == ONE else _batched(runtime, reqs, int(c[2:])))
            progress(f"repeat {rep + 1}/{repeats} {c}: {runs[c][-1]['tokens_s']:.2f} tok/s")
    return runs


def summary(runs: dict[str, list[dict]]) -> list[dict]:
    """One JSON-able row per configuration."""
    want = runs[ONE][0]["tokens"]
    base = statistics.median(r["tokens_s"] for r in runs[ONE])
    rows = []
    for c, rs in runs.items():
        rates = [r["tokens_s"] for r in rs]
        u, last = rs[-1]["utilization"], rs[-1]
        rows.append(dict(config=c, tokens_s=statistics.median(rates), tokens_s_min=min(rates), tokens_s_max=max(rates),
                         x_one=statistics.median(rates) / base, tpot_ms=statistics.median(r["tpot_ms"] for r in rs),
                         ttft_s=statistics.median(r["ttft_s"] for r in rs), rows_per_step=last["rows_per_step"],
                         utilization=None if u is None else dict(overall=u.overall, per_stage=list(u.per_stage),
                                                                  text=format_utilization(u)),
                         equal=sum(a == b for a, b in zip(last["tokens"], want)), requests=len(want),
                         tick_ms=last["tick_ms"], stage_ms=last["stage_ms"], pdm_ms=last["pdm_ms"]))
    return rows


def format_summary(rows: list[dict]) -> list[str]:
    """Markdown tables: throughput and latency against B, then the per-tick breakdown."""
    out = ["| configuration | tok/s median (min-max) | x one at a time | TPOT ms (median request) | "
           "TTFT s (median request) | rows per stage step | stage utilization | "
           "tokens = one at a time |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        util = "-" if r["utilization"] is None else r["utilization"]["text"]
        out.append(f"| {r['config']} | {r['tokens_s']:.2f} ({r['tokens_s_min']:.2f}-{r['tokens_s_max']:.2f}) | "
                   f"{r['x_one']:.2f} | {r['tpot_ms']:.1f} | {r['ttft_s']:.2f} | {r['rows_per_step']:.2f} | {util} | "
                   f"{r['equal']}/{r['requests']} |")
    out += ["", "per tick, last repeat (a tick of a batch run carries every live request's token):",
            "| configuration | ms per tick | stage compute ms per step | driver PDM ms per tick |", "|---|---|---|---|"]
    out += [f"| {r['config']} | {r['tick_ms']:.1f} | {' / '.join(f'{x:.1f}' for x in r['stage_ms'])} | "
            f"{r['pdm_ms']:.1f} |" for r in rows]
    return out

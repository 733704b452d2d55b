"""Compute profiles (`spd-profile/1`, the cost model's input) from two sources:

- `profile_from_bench`: a same-run `spd bench` report on the real runtime (ar row + a traced spd
  row): per-stage mean compute, the driver's mean PDM, verify and other per-tick host work, and
  layer_ms from the AR decode time. Means, not medians: decode tok/s is total time over tokens,
  and on a loaded host step times are heavy-tailed, so medians would predict too fast;
- `measure_shape`: step times of one model shape on one device with random weights (what
  `spd profile` runs): per-stage one-token steps at several n, the PDM step, verification and
  the AR step, each eager and, on CUDA, as CUDA graphs (engine/model/graphs.py).

Device step times are medians over single steps with a device synchronisation after each (a
pipeline stage waits for its result before sending it); a dedicated device has no heavy tail.
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from spd_engine.engine.model.graphs import PDMStep, StageStep, VerifyStep
from spd_engine.engine.model.model import StageModel
from spd_engine.engine.model.model_config import ModelConfig
from spd_engine.engine.model.pdm import PDM, PDMConfig
from spd_engine.engine.model.tp_shard import shard_config
from spd_engine.engine.protocol.anchors import AnchorPlan
from spd_engine.engine.protocol.topology import default_stage_layers, stage_bounds
from spd_engine.engine.runtime.run_config import DTYPES, RunConfig

SCHEMA = "spd-profile/1"
Log = Callable[[str], None]


# ---------------------------------------------------------------- from a same-run bench report

def _mean(xs: list[float]) -> float:
    if not xs:
        raise ValueError("profile: no samples to average (is the spd run traced and long enough?)")
    return sum(xs) / len(xs)


def stage_compute_ms(traces: list[dict]) -> list[float]:
    """Mean compute per stage over the token steps of every traced request: each stage's trace
    is a list of (recv start, compute start, compute end) triples."""
    n = len(traces[0]["stages"])
    return [1e3 * _mean([c1 - c0 for t in traces for _, c0, c1 in t["stages"][s]]) for s in range(n)]


def _driver_ticks(trace: dict) -> tuple[dict[int, dict[str, float]], dict[int, float], dict[int, float]]:
    """Per decode tick of one request: ms per timed part, the tick's span to the next tick (ms),
    and its start (perf_counter s)."""
    by_tick: dict[int, dict[str, float]] = {}
    start: dict[int, float] = {}
    for tick, what, t0, t1 in trace["driver"]:
        if tick < 1:
            continue  # prefill
        parts = by_tick.setdefault(int(tick), {})
        parts[what] = parts.get(what, 0.0) + 1e3 * (t1 - t0)
        start[int(tick)] = min(start.get(int(tick), t0), t0)
    spans = {t: 1e3 * (start[t + 1] - start[t]) for t in by_tick if t + 1 in start}
    return by_tick, spans, start


def residual_per_tick_ms(trace: dict) -> list[float]:
    """A co-located request's residual per decode tick (ms): the tick's span less the busiest rank's
    work in it, i.e. what the tick spends beyond compute (the transport, the bookkeeping, the
    reads: docs/benchmarks.md). The driver's rank works stage 0's compute (inline) and the
    driver's PDM and verify; every other stage's rank its compute (a last stage that verifies:
    its head too). Compute is clipped to the tick's window; the ranks share one clock
    (perf_counter is the host's monotonic clock)."""
    by_tick, spans, start = _driver_ticks(trace)
    computes = [sorted((c0, c1) for _, c0, c1 in steps) for steps in trace["stages"]]
    out = []
    for t in sorted(spans):
        a, b = start[t], start[t] + spans[t] / 1e3
        inside = [_overlap_ms(c, a, b) for c in computes]
        parts = by_tick[t]
        rank0 = inside[0] + parts.get("pdm", 0.0) + parts.get("verify", 0.0)
        out.append(spans[t] - max([rank0] + inside[1:]))
    return out


def _overlap_ms(intervals: list[tuple[float, float]], a: float, b: float) -> float:
    """ms of the sorted (start, end) intervals (s) inside [a, b)."""
    return 1e3 * sum(max(0.0, min(c1, b) - max(c0, a)) for c0, c1 in intervals if c0 < b and c1 > a)


def driver_tick_ms(traces: list[dict]) -> dict[str, float]:
    """Means over the decode ticks of every traced request of the driver's timed parts (send,
    wait, pdm; verify over the ticks that verify) and of the untimed rest ("other": embedding the
    entering token, ring writes, bookkeeping = tick span minus timed parts), from the driver's
    (tick, what, t0, t1) events."""
    parts, rest, spans = [], [], []
    for trace in traces:
        by_tick, span, _ = _driver_ticks(trace)
        parts += list(by_tick.values())
        rest += [span[t] - sum(by_tick[t].values()) for t in span]
        spans += list(span.values())
    out = {what: _mean([p.get(what, 0.0) for p in parts]) for what in ("pdm", "send", "stage0", "wait")}
    out["verify"] = _mean([p["verify"] for p in parts if "verify" in p])
    out["other"] = max(0.0, _mean(rest))
    out["tick"] = _mean(spans)
    return out


def choose_spd_row(report: dict, cores: int | None) -> dict:
    """The traced spd row to profile: the separate-driver run when its ranks fit the host's
    cores, else the co-located one (oversubscribed ranks measure time-sharing, not compute)."""
    traced = {r["name"]: r for r in report["rows"] if r["mode"] == "spd" and r["name"] in report["request_traces"]}
    if not traced:
        raise ValueError("profile: the bench report has no traced spd run (run spd or spd-colocate)")
    sep, col = traced.get("spd"), traced.get("spd-colocate")
    if sep is not None and (cores is None or sep["world_size"] <= cores or col is None):
        return sep
    return col if col is not None else sep


def last_stage_verify_ms(row: dict, n: int, driver_verify_ms: float) -> float | None:
    """The last stage's mean head time per token step when it ran T=0 verification's head
    (--verify-at last: `stage{n-1}_verify_ms` of the row's breakdown, engine/protocol/metrics.py), else
    None. A last stage that was asked to verify but replied -1 (T > 0) reports a few
    microseconds while the driver verified, so the head is where the larger time is."""
    ms = row.get("breakdown_ms_per_tick", {}).get(f"stage{n - 1}_verify_ms")
    return ms if ms is not None and ms > driver_verify_ms else None


def profile_from_bench(report: dict, ecfg: RunConfig, cores: int | None, host: str = "") -> dict:
    """spd-profile/1 from a same-run bench report (needs the ar row and a traced spd row).

    stage_ms[n] = per-stage mean compute without the head; pp_stage_ms[n] = the same from a traced
    pp row (its last stage's includes the head; stages that idle between tokens, as pp's do, can
    compute slower than SPD's busy ones); pdm_ms[n] = the driver's mean; verify_ms = the head's
    time where it ran: the driver's mean verification, or, when the last stage verified
    (source.verify_at "last"), its mean head time, which is then taken out of its stage_ms (the
    cost model adds it back where the plan says the head runs) and the driver's remaining
    compare counts as its host work; driver_fixed_ms = the driver's untimed per-tick work
    (co-located: plus stage 0's step overhead beyond its compute: the driver's send and inline
    stage0 step minus stage 0's compute); layer_ms = (AR decode ms per token - verify_ms) / L, so
    the model's AR time (layers + verify) is the measured one (the embedding and the AR loop's
    host work are spread over the layers)."""
    rows = {r["name"]: r for r in report["rows"]}
    if "ar" not in rows:
        raise ValueError("profile: the bench report has no ar row")
    row = choose_spd_row(report, cores)
    traces = report["request_traces"][row["name"]]
    stages = stage_compute_ms(traces)
    drv = driver_tick_ms(traces)
    n, L = len(stages), ecfg.model.cfg.num_layers
    assert n == ecfg.parallel.topology.n, (n, ecfg.parallel.topology.n)
    fixed = drv["other"] + (max(0.0, drv["send"] + drv["stage0"] - stages[0]) if row["colocate"] else 0.0)
    on_last = last_stage_verify_ms(row, n, drv["verify"])
    verify = drv["verify"] if on_last is None else on_last
    if on_last is not None:
        stages[-1] = max(0.0, stages[-1] - on_last)  # the model adds the head back on the last stage
        fixed += drv["verify"]  # the driver's compare of the stage's token: host work, not a head
    ar_ms = rows["ar"]["tick_ms"]
    plan = AnchorPlan.build(stage_bounds(list(ecfg.parallel.topology.stage_layers)), ecfg.drafting.anchors)
    out = {
        "schema": SCHEMA, "name": f"{_short(ecfg.model.source)}-n{n}-{ecfg.parallel.device}",
        "num_layers": L, "layer_ms": max(0.0, ar_ms - verify) / L,
        "pdm_ms": {str(n): drv["pdm"]}, "verify_ms": verify, "driver_fixed_ms": fixed,
        "hidden_size": ecfg.model.cfg.hidden_size, "dtype_bytes": DTYPES[ecfg.model.dtype].itemsize,
        "anchors_per_stage": max(1, max(len(plan.anchors_of_stage(s)) for s in range(n))),
        "stage_ms": {str(n): stages},
        "source": {"from": "spd bench", "model": ecfg.model.source, "head": ecfg.drafting.pdm, "device": ecfg.parallel.device,
                   "dtype": ecfg.model.dtype, "threads_per_rank": row["threads_per_rank"], "spd_row": row["name"],
                   "ranks": row["world_size"], "stage_layers": list(ecfg.parallel.topology.stage_layers),
                   "verify_at": "driver" if on_last is None else "last",
                   "synthetic_alpha": report.get("synthetic_alpha"), "alpha_measured": row["alpha"], "host": host},
        "measured": {"ar_token_ms": ar_ms, "driver_ms_per_tick": drv, "spd_tick_ms": row["tick_ms"],
                     "last_stage_verify_ms": on_last},
    }
    if "pp" in report["request_traces"]:  # a traced pp row: its own stage times (bench/validate_runtime.py)
        out["pp_stage_ms"] = {str(n): stage_compute_ms(report["request_traces"]["pp"])}
    return out


def _short(model: str) -> str:
    return model.split(":", 1)[1] if model.startswith("random:") else model.rstrip("/").rsplit("/", 1)[-1]


# ---------------------------------------------------------------- on a device, random weights

@dataclass(frozen=True)
class DeviceSettings:
    device: str = "cuda"
    dtype: str = "bfloat16"
    ns: tuple[int, ...] = (2, 4, 8)
    context: int = 1024  # KV positions before the timed token (attention length)
    iters: int = 50
    warmup: int = 5
    graphs: bool = True
    pdm_layers: int = 1  # K
    seed: int = 0


def time_ms(fn: Callable[[], object], device: torch.device, iters: int, warmup: int) -> float:
    """Median ms of one call followed by a device synchronisation."""
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    for _ in range(warmup):
        fn()
    sync()
    samples = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        sync()
        samples.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(samples)


def events_ms(fn: Callable[[], object], iters: int) -> float:
    """Mean ms per call by CUDA events around `iters` back-to-back calls after one warm-up call
    (kernel timings: no host sync between the calls)."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


@torch.no_grad()
def randomize_(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Random weights drawn on the module's device (fast for 8B shapes): norms near 1, else std 0.02."""
    p0 = next(module.parameters())
    gen = torch.Generator(device=p0.device).manual_seed(seed)
    for name, p in module.named_parameters():
        if "norm" in name:
            p.normal_(1.0, 0.1, generator=gen)
        else:
            p.normal_(0.0, 0.02, generator=gen)
    return module


def _stage(cfg: ModelConfig, layers: range, embedding: bool, head: bool, s: DeviceSettings, seed: int) -> StageModel:
    model = StageModel(cfg, layers, embedding=embedding, head=head, device=s.device, dtype=DTYPES[s.dtype])
    return randomize_(model, seed).eval()


def _step_times(model: StageModel, s: DeviceSettings) -> tuple[float, float | None, str]:
    """(eager ms, graphed ms or None, graph mode) of one token step at position context - 1."""
    dev, pos = torch.device(s.device), s.context - 1
    H = model.cfg.hidden_size
    h = torch.randn(1, 1, H, device=dev, generator=torch.Generator(dev).manual_seed(s.seed)).to(DTYPES[s.dtype])
    tok = torch.full((1, 1), 3, dtype=torch.long, device=dev)

    cache = model.new_cache(1, s.context)

    def eager():
        x = model.embed(tok) if model.has_embedding else h
        out, _ = model.forward_layers(x, cache, pos)
        return model.logits(out[0, -1]).argmax() if model.has_head else out

    eager_ms = time_ms(eager, dev, s.iters, s.warmup)
    step = StageStep(model, model.new_cache(1, s.context), graphs=s.graphs)
    run = (lambda: step.run(pos, token=3)) if model.has_embedding else (lambda: step.run(pos, h=h))
    run()
    mode = next(iter(step.modes().values()))
    graphed = time_ms(run, dev, s.iters, s.warmup) if "cuda graph" in mode else None
    return eager_ms, graphed, mode


def _pdm_times(cfg: ModelConfig, n: int, s: DeviceSettings, seed: int) -> tuple[float, float | None, str]:
    """PDM step with n + 1 rows (pending full-depth row + n in-flight rows): K layers, draft head, argmax."""
    counts = default_stage_layers(cfg.num_layers, n)
    plan = AnchorPlan.build(stage_bounds(counts), None)
    pdm = randomize_(PDM(cfg, PDMConfig(tuple(counts), plan.anchors, s.pdm_layers), device=s.device,
                         dtype=DTYPES[s.dtype]), seed).eval()
    dev, R = torch.device(s.device), n + 1
    pos = s.context - R
    rows = torch.randn(1, R, cfg.hidden_size, device=dev, generator=torch.Generator(dev).manual_seed(seed))
    rows = rows.to(DTYPES[s.dtype])
    cache = pdm.new_cache(s.context)

    def eager():
        h = pdm.forward_rows(rows, cache, pos)
        return pdm.draft_logits(h[0, -1]).argmax()

    eager_ms = time_ms(eager, dev, s.iters, s.warmup)
    step = PDMStep(pdm, pdm.new_cache(s.context), R, graphs=s.graphs)
    step.run(pos, rows)
    mode = next(iter(step.modes().values()))
    graphed = time_ms(lambda: step.run(pos, rows), dev, s.iters, s.warmup) if "cuda graph" in mode else None
    return eager_ms, graphed, mode


def _verify_times(model: StageModel, s: DeviceSettings) -> tuple[float, float | None, str]:
    dev = torch.device(s.device)
    h = torch.randn(model.cfg.hidden_size, device=dev, generator=torch.Generator(dev).manual_seed(s.seed))
    h = h.to(DTYPES[s.dtype])
    eager_ms = time_ms(lambda: model.logits(h).argmax(), dev, s.iters, s.warmup)
    step = VerifyStep(model, graphs=s.graphs)
    graphed = time_ms(lambda: step.run(h), dev, s.iters, s.warmup) if step.graph.graphed else None
    return eager_ms, graphed, step.mode


def _free(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def measure_shape(cfg: ModelConfig, s: DeviceSettings, log: Log = lambda m: None) -> dict:
    """Raw step times (ms) of one model shape: AR, verify, PDM per n, every stage per n."""
    out: dict = {"modes": set(), "stage_ms": {}, "pdm_ms": {}}
    full = _stage(cfg, range(cfg.num_layers), True, True, s, s.seed)
    e, g, mode = _step_times(full, s)
    out["ar_ms"] = {"eager": e, "graphed": g}
    out["modes"].add(mode)
    ve, vg, vmode = _verify_times(full, s)
    out["verify_ms"] = {"eager": ve, "graphed": vg}
    out["modes"].add(vmode)
    log(f"  AR step {g or e:.3f} ms, verify {vg or ve:.3f} ms ({mode})")
    del full
    _free(s.device)
    out["tp_layer_ms"] = _tp_layer_ms(cfg, s, log)
    for n in s.ns:
        if n > cfg.num_layers:
            log(f"  n={n} skipped: the model has {cfg.num_layers} layers")
            continue
        counts, eager, graphed = default_stage_layers(cfg.num_layers, n), [], []
        for p, layers in enumerate(_ranges(counts)):
            stage = _stage(cfg, layers, p == 0, False, s, s.seed + p)
            e, g, mode = _step_times(stage, s)
            eager.append(e)
            graphed.append(g)
            out["modes"].add(mode)
            del stage
            _free(s.device)
        e, g, mode = _pdm_times(cfg, n, s, s.seed + 100)
        out["stage_ms"][n] = {"eager": eager, "graphed": None if None in graphed else graphed}
        out["pdm_ms"][n] = {"eager": e, "graphed": g}
        out["modes"].add(mode)
        best = out["stage_ms"][n]["graphed"] or eager
        log(f"  n={n}: stages {', '.join(f'{x:.3f}' for x in best)} ms; PDM ({n + 1} rows) {g or e:.3f} ms")
        _free(s.device)
    out["modes"] = sorted(out["modes"])
    return out


def _tp_layer_ms(cfg: ModelConfig, s: DeviceSettings, log: Log) -> dict[int, dict]:
    """Per-layer ms of one 1/g tensor-parallel shard of every layer (its own query groups and MLP
    slice: engine/model/tp_shard.py), for the g in 2, 4, 8 the shape allows; the all-reduces are the
    links' (netbench), not timed here."""
    out = {}
    for g in (2, 4, 8):
        try:
            local = shard_config(cfg, g)
        except ValueError:
            continue
        shard = _stage(local, range(cfg.num_layers), False, False, s, s.seed + 200 + g)
        e, gr, _ = _step_times(shard, s)
        out[g] = {"eager": e / cfg.num_layers, "graphed": None if gr is None else gr / cfg.num_layers}
        log(f"  TP shard 1/{g}: {(gr or e) / cfg.num_layers:.4f} ms per layer")
        del shard
        _free(s.device)
    return out


def _ranges(counts: list[int]) -> list[range]:
    bounds = stage_bounds(counts)
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


def fully_graphed(raw: dict) -> bool:
    """Whether every step of measure_shape's output was timed as a CUDA graph."""
    steps = [raw["ar_ms"], raw["verify_ms"], *raw["pdm_ms"].values(), *raw["stage_ms"].values()]
    return all(d["graphed"] is not None for d in steps)


def profile_json(name: str, cfg: ModelConfig, raw: dict, s: DeviceSettings, graphed: bool, device_name: str) -> dict:
    """spd-profile/1 from measure_shape's output, all graphed times or all eager ones.
    layer_ms = (AR step - verify) / L: the AR step includes the embedding."""
    if graphed and not fully_graphed(raw):
        raise ValueError(f"{name}: not every step was captured as a CUDA graph; use the eager profile")
    kind = "graphed" if graphed else "eager"
    pick = lambda d: d[kind]  # noqa: E731
    verify = pick(raw["verify_ms"])
    return {
        "schema": SCHEMA, "name": f"{name}-{device_name}-{'graphs' if graphed else 'eager'}",
        "num_layers": cfg.num_layers, "layer_ms": max(0.0, pick(raw["ar_ms"]) - verify) / cfg.num_layers,
        "pdm_ms": {str(n): pick(v) for n, v in raw["pdm_ms"].items()}, "verify_ms": verify,
        "hidden_size": cfg.hidden_size, "dtype_bytes": DTYPES[s.dtype].itemsize, "anchors_per_stage": 1,
        "stage_ms": {str(n): pick(v) for n, v in raw["stage_ms"].items()},
        "tp_layer_ms": {str(g): pick(v) for g, v in raw.get("tp_layer_ms", {}).items() if pick(v) is not None},
        "source": {"from": "spd profile", "device": device_name, "dtype": s.dtype, "context": s.context,
                   "pdm_layers": s.pdm_layers, "weights": "random", "timing": kind, "modes": raw["modes"]},
        "measured": {"ar_ms": raw["ar_ms"], "verify_ms": raw["verify_ms"],
                     "stage_ms": {str(n): v for n, v in raw["stage_ms"].items()},
                     "pdm_ms": {str(n): v for n, v in raw["pdm_ms"].items()}},
    }

"""Same-run speed benchmark: ar, pp and spd (driver on its own rank and co-located) on the
same prompts and machine, one launch per configuration, medians over repeats; optionally
transformers' own generate beside them (bench/hf_peer.py: `hf`, `hf-lookup`).

Every engine configuration must produce the ar baseline's tokens (T=0): the benchmark doubles as a
losslessness check. An external peer's equality with them is reported (`equal_prompts`), not
required: its kernels round differently. Latency is reported as the serving benchmarks do (vLLM's): TTFT (request
start to the first token), TPOT (per request: (last - first token time) / (tokens - 1)) and the
inter-token latency (ITL: every gap between consecutive tokens), as p50 / p90 / p99 through
numpy.percentile over every request and gap of every repeat; token times are taken when the
driver commits each token (its on_token callback). A synthetic-acceptance option replaces the PDM's draft with the reference
token with probability alpha (seeded), so speed can be measured at a known alpha on random
weights of any shape; results carry `synthetic_alpha` so they are never mistaken for a real head.
"""
from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from spd_engine.bench.hf_peer import HFPeer
from spd_engine.bench.profiling import residual_per_tick_ms
from spd_engine.bench.speedups import add_speedups
from spd_engine.costmodel.cost_partitions import rebalanced_split
from spd_engine.engine.protocol.metrics import GenerationResult
from spd_engine.engine.runtime.launch import launch
from spd_engine.engine.runtime.run_config import Mode, RunConfig

Progress = Callable[[str], None]


PERCENTILES = (50, 90, 99)


@dataclass(frozen=True)
class BenchCase:
    name: str  # ar | pp | spd | spd-colocate | spd-overlap | eagle | hf | hf-lookup | hf-assisted
    ecfg: RunConfig  # for an external peer: the ar row's (its thread count and dtype)
    peer: HFPeer | None = None  # transformers' generate instead of the engine (bench/hf_peer.py)

    @property
    def mode(self) -> str:
        return "hf" if self.peer is not None else self.ecfg.mode

    def open(self):
        return self.peer.open() if self.peer is not None else launch(self.ecfg)


@dataclass
class TokenClock:
    """Wall times of one request: its start and the commit time of every token."""

    start: float = field(default_factory=time.perf_counter)
    times: list[float] = field(default_factory=list)

    def on_token(self, _token: int) -> None:
        self.times.append(time.perf_counter())


def latency_summary(clocks: list[TokenClock]) -> dict:
    """TTFT, TPOT and ITL percentiles (ms) and means over requests (numpy.percentile, linear)."""
    ttft = [1e3 * (c.times[0] - c.start) for c in clocks if c.times]
    tpot = [1e3 * (c.times[-1] - c.times[0]) / (len(c.times) - 1) for c in clocks if len(c.times) > 1]
    itl = [1e3 * d for c in clocks for d in np.diff(c.times)]
    out = {}
    for name, values in (("ttft", ttft), ("tpot", tpot), ("itl", itl)):
        arr = np.asarray(values, dtype=np.float64)
        out[f"{name}_mean_ms"] = float(arr.mean()) if arr.size else None
        for q in PERCENTILES:
            out[f"{name}_p{q}_ms"] = float(np.percentile(arr, q)) if arr.size else None
    return out


def synthetic_policy(reference: list[int], prompt_len: int, alpha: float, seed: int):
    """Draft policy: the reference token with probability alpha, else a wrong token (seeded per position)."""
    def policy(pos: int, draft: int) -> int:
        i = pos - prompt_len
        if i >= len(reference):
            return draft
        good = random.Random(seed * 1_000_003 + pos).random() < alpha
        return reference[i] if good else (reference[i] + 1) % 2**31
    return policy


def summarize(runs: list[list[GenerationResult]], n: int) -> dict:
    """Pool each repeat over its prompts; report medians and spread over repeats."""
    per_repeat = []
    for results in runs:
        dec_tokens = sum(r.decode_tokens for r in results)
        dec_s = sum(r.decode_s for r in results)
        ticks = sum(r.ticks for r in results)
        per_repeat.append({
            "decode_tok_s": dec_tokens / dec_s if dec_s else 0.0,
            "prefill_s": sum(r.prefill_s for r in results),
            "tick_ms": 1e3 * dec_s / ticks if ticks else 0.0,
        })
    first = runs[0]
    verified = sum(r.verified for r in first)
    out = {
        "repeats": len(runs),
        "tokens": sum(len(r.tokens) for r in first),
        "ticks": sum(r.ticks for r in first),
        "alpha": sum(r.accepted for r in first) / verified if verified else None,
        "eal": n * sum(r.decode_tokens for r in first) / max(1, sum(r.ticks for r in first)),
    }
    # every repeat's rate, in run order: ratios to another row pair repeat i with its repeat i (bench/speedups.py)
    out["decode_tok_s_per_repeat"] = [p["decode_tok_s"] for p in per_repeat]
    for key in ("decode_tok_s", "prefill_s", "tick_ms"):
        vals = [p[key] for p in per_repeat]
        out[key] = statistics.median(vals)
        out[key + "_min"], out[key + "_max"] = min(vals), max(vals)
    breakdowns = [r.breakdown_ms_per_tick() for results in runs for r in results if r.ticks]
    keys = sorted({k for b in breakdowns for k in b})
    out["breakdown_ms_per_tick"] = {k: statistics.median(b[k] for b in breakdowns if k in b) for k in keys}
    return out


def colocated_residual(runs: list[list[GenerationResult]], traces: list[dict] | None) -> dict:
    """The co-located tick beyond the busiest rank's work (the driver's rank: stage 0's compute,
    the PDM, the driver's verification; any other: its stage's compute, a verifying last stage's
    head included): `residual_ms`, the median over requests of its mean per tick, and the p50 /
    p90 over the ticks of the last repeat's traced requests (bench/profiling.py). The mean carries
    the host's rare long stalls; the per-tick p50 is the typical tick."""
    means = []
    for b in (r.breakdown_ms_per_tick() for results in runs for r in results if r.ticks):
        rank0 = b["stage0_compute_ms"] + b["driver_pdm_ms"] + b["driver_verify_ms"]
        others = [v for k, v in b.items() if k.startswith("stage") and k.endswith("_compute_ms") and k != "stage0_compute_ms"]
        means.append(b["tick_ms"] - max([rank0] + others))
    ticks = sorted(x for t in traces or () for x in residual_per_tick_ms(t))
    if not means or not ticks:
        return {"residual_ms": None}
    return {"residual_ms": statistics.median(means), "residual_ticks": len(ticks),
            "residual_tick_p50_ms": statistics.median(ticks),
            "residual_tick_p90_ms": ticks[min(len(ticks) - 1, int(0.9 * len(ticks)))]}


def split_advice(breakdown: dict[str, float], counts: Sequence[int], colocate: bool) -> dict:
    """The split that balances an SPD run's measured per-tick costs (costmodel/cost_partitions.py
    rebalanced_split): each stage's layers (its compute less a verifying head's), and besides them
    the co-located driver's PDM and verification on stage 0's rank and the head on a verifying
    last stage. Keys: stage_layers, busiest_ms (this split, from its parts), balanced_layers,
    balanced_busiest_ms (predicted)."""
    n = len(counts)
    verify = [breakdown.get(f"stage{p}_verify_ms", 0.0) for p in range(n)]
    layers = [breakdown[f"stage{p}_compute_ms"] - verify[p] for p in range(n)]
    extra = list(verify)
    if colocate:
        extra[0] += breakdown["driver_pdm_ms"] + breakdown["driver_verify_ms"] + breakdown.get("driver_other_ms", 0.0)
    best, best_ms, now_ms = rebalanced_split(list(counts), layers, extra)
    return {"stage_layers": list(counts), "busiest_ms": now_ms, "balanced_layers": best, "balanced_busiest_ms": best_ms}


def run_case(case: BenchCase, prompts: Sequence[list[int]], max_new: int, eos: Sequence[int], repeats: int,
             reference: list[list[int]] | None, synthetic_alpha: float | None, seed: int,
             progress: Progress) -> tuple[dict, list[list[int]], list[dict] | None]:
    """(summary, tokens per prompt, the traces of the last repeat's requests or None) for one configuration."""
    policies = [None] * len(prompts)
    if synthetic_alpha is not None and case.ecfg.mode in (Mode.SPD, Mode.EAGLE):
        assert reference is not None, "synthetic acceptance needs the reference tokens"
        policies = [synthetic_policy(ref, len(p), synthetic_alpha, seed) for ref, p in zip(reference, prompts)]
    runs: list[list[GenerationResult]] = []
    clocks: list[TokenClock] = []
    trace = None
    with case.open() as rt:
        rt.generate(prompts[0], min(8, max_new), eos)  # warm-up: first-call allocations, page faults
        for rep in range(repeats):
            progress(f"{case.name}: repeat {rep + 1}/{repeats}")
            results = []
            for p, pol in zip(prompts, policies):
                clocks.append(TokenClock())
                results.append(rt.generate(p, max_new, eos, draft_policy=pol, on_token=clocks[-1].on_token))
            runs.append(results)
        if case.ecfg.runtime.trace:
            trace = [r.trace for r in runs[-1]]
    summary = summarize(runs, case.ecfg.parallel.topology.n)
    summary.update(latency_summary(clocks))
    if case.name in ("spd-colocate", "spd-colocate-vd"):
        summary.update(colocated_residual(runs, trace))
    if case.ecfg.mode is Mode.SPD and case.ecfg.parallel.topology.n > 1 and summary["breakdown_ms_per_tick"]:
        summary["split"] = split_advice(summary["breakdown_ms_per_tick"], case.ecfg.parallel.topology.stage_layers,
                                        case.ecfg.parallel.topology.colocate)
    if case.ecfg.mode is Mode.EAGLE or (case.peer is not None and (case.peer.lookup_tokens or case.peer.assistant_dir)):
        summary["acceptance_length"] = summary["eal"]  # ticks are target passes and n = 1: tokens per pass
    if case.ecfg.mode is not Mode.SPD:
        summary["eal"] = None  # EAL is SPD's; pp and ar commit one token per pass
    summary.update(name=case.name, mode=case.mode, n=case.ecfg.parallel.topology.n, tp=case.ecfg.parallel.topology.tp,
                   colocate=case.ecfg.parallel.topology.colocate, world_size=case.ecfg.world_size,
                   threads_per_rank=case.ecfg.threads_per_rank(), synthetic_alpha=synthetic_alpha)
    return summary, [r.tokens for r in runs[0]], trace


def bench(cases: list[BenchCase], prompts: Sequence[list[int]], max_new: int, eos: Sequence[int], repeats: int,
          synthetic_alpha: float | None = None, seed: int = 0, progress: Progress = lambda m: None) -> dict:
    """Run every case (the first must be `ar`); speedups are against ar, pp, hf and hf-lookup of this
    run, each with its spread over repeats and a noisy mark (bench/speedups.py).
    `eos` empty: every request runs to max_new tokens (--ignore-eos)."""
    assert cases and cases[0].ecfg.mode is Mode.AR, "the ar baseline runs first: it is the reference"
    rows, traces, request_traces, mismatches, peer_mismatches = [], {}, {}, [], []
    references: dict[int, list[list[int]]] = {}  # TP split -> its greedy output: ar for 1, the first tp row for T
    for case in cases:
        split = case.ecfg.parallel.topology.tp
        reference = references.get(split)
        summary, tokens, trace = run_case(case, prompts, max_new, eos, repeats, references.get(1), synthetic_alpha,
                                          seed, progress)
        if reference is None:
            references[split] = reference = tokens
        summary["lossless"] = tokens == reference
        summary["equal_prompts"] = sum(a == b for a, b in zip(tokens, references[1]))  # against ar
        if not summary["lossless"]:  # an external peer computes with other kernels: reported, not a failure
            (peer_mismatches if case.peer else mismatches).append(case.name)
        if split > 1:  # the split changes the reduction order: greedy may part from unsharded at a near-tie
            summary["outputs_unlike_ar"] = sum(r != t for r, t in zip(references[1], tokens))
        rows.append(summary)
        if trace is not None:
            traces[case.name] = trace[0]  # one request: the timeline plot
            request_traces[case.name] = trace  # every request of the last repeat: profiles
    add_speedups(rows)
    return {"rows": rows, "mismatches": mismatches, "peer_mismatches": peer_mismatches, "traces": traces,
            "request_traces": request_traces, "synthetic_alpha": synthetic_alpha, "ignore_eos": not eos,
            "prompts": len(prompts), "max_new_tokens": max_new, "repeats": repeats}

"""Validation of the cost model against the real runtime: predictions from inputs measured in
separate runs, compared with an independent measurement.

1. profile run: `spd bench` (ar, pp, spd-colocate, spd) with traced spd ticks -> an
   `spd-profile/1` (bench/profiling.py) and the measured acceptance alpha;
2. netbench run: P2P at the runtime's message sizes between n + 1 local ranks -> link model;
3. measurement run: the same `spd bench` again, in fresh processes.
The SPD runs verify where `ValidationSettings.verify_at` says (RunConfig.parallel.verify_at), and the
model prices the SPD rows the same way (costmodel/cost_model.py `plan`'s verify_at).
The cost model (costmodel/cost_model.py `plan`) predicts from 1 + 2 the decode tok/s and the time
per tick of ar, pp and SPD (co-located and separate driver) at this n, and these are compared
with 3. This repeats for a few rounds and medians over rounds are compared: on a shared host
the machine's speed swings over minutes, and one pair of runs can land on different sides of
a swing. Every request decodes exactly `max_new_tokens` (no EOS stop), so all runs do the same
work; acceptance is whatever the head (or `synthetic_alpha`, labelled) gives.
"""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from statistics import median

from spd_engine.bench.profiling import profile_from_bench
from spd_engine.bench.speed import BenchCase, bench
from spd_engine.costmodel.cost_inputs import AlphaCurve, LinkModel, Profile, message_bytes
from spd_engine.costmodel.cost_model import Links, plan
from spd_engine.costmodel.cost_model_spd import eal_for_request
from spd_engine.engine.protocol.messages import HEADER_LEN
from spd_engine.engine.runtime.run_config import VERIFY_AT, RunConfig

CONFIGS = ("ar", "pp", "spd-colocate", "spd")
TP_CONFIG = "tp"  # --mode tp over ValidationSettings.tp ranks (optional)
Progress = Callable[[str], None]


@dataclass(frozen=True)
class ValidationSettings:
    max_new_tokens: int = 48
    rounds: int = 3  # each: profile run, netbench run, measurement run; medians over rounds are compared
    repeats: int = 1  # repeats inside each bench run (their median is the run's value)
    synthetic_alpha: float | None = 0.8  # None: the head's own drafts
    seed: int = 0
    tolerance: float = 0.15
    latency_stat: str = "idle_mean_us"
    net_iters: int = 100
    timeout_s: float = 60.0
    configs: tuple[str, ...] = CONFIGS  # a subset runs faster (tests); ar always runs; "tp" adds the TP row
    tp: int = 1  # ranks of the tp row
    tp_steps: int = 64  # timed decode steps of the TP shard measurement (bench/tp_shard_time.py)
    # which hops price the runs, and so what the runs use: "p2p" raw gloo P2P (runs on gloo), "gloo"
    # the gloo frame transport's own rows (runs on gloo), "shm" the shared-memory rings' (runs on shm)
    link: str = "p2p"
    verify_at: str = "auto"  # where the SPD runs verify at T=0 (RunConfig.parallel.verify_at), and so how they are priced

    def __post_init__(self) -> None:
        if self.link not in ("p2p", "gloo", "shm"):
            raise ValueError(f"validation link must be p2p, gloo or shm, got {self.link!r}")
        if self.verify_at not in VERIFY_AT:
            raise ValueError(f"validation verify_at must be one of {VERIFY_AT}, got {self.verify_at!r}")

    @property
    def transport(self) -> str:
        """The runtime's transport in the measured runs."""
        return "shm" if self.link == "shm" else "gloo"


def bench_cases(ecfg: RunConfig, configs: Sequence[str] = CONFIGS, tp: int = 1, transport: str = "gloo",
                verify_at: str = "auto") -> list[BenchCase]:
    """ar on one rank, pp on n (traced), SPD co-located on n and with a separate driver on n + 1 (traced),
    both verifying at `verify_at`, and with "tp" --mode tp on `tp` ranks; `configs` picks a subset (ar,
    the reference and the source of layer_ms, always runs)."""
    bad = set(configs) - set(CONFIGS) - {TP_CONFIG}
    if bad or not {"spd", "spd-colocate"} & set(configs):
        raise ValueError(f"validation configs must be among {CONFIGS + (TP_CONFIG,)} and include an SPD run, "
                         f"got {list(configs)}")
    if (TP_CONFIG in configs) != (tp > 1):
        raise ValueError(f"the {TP_CONFIG} config needs tp >= 2 and tp >= 2 the {TP_CONFIG} config (got tp={tp})")
    topo = dataclasses.replace(ecfg.parallel.topology, tp=1)
    # the transport whose rows the netbench run measures (the link model's input): gloo for its P2P
    # or frame rows, shm for the rings' rows
    ecfg = ecfg.replace(topology=topo, transport=transport, verify_at=verify_at)  # verify_at: SPD's only
    one = dataclasses.replace(topo, stage_layers=(topo.num_layers,), colocate=False)
    every = {"ar": BenchCase("ar", ecfg.replace(mode="ar", topology=one)),
             "pp": BenchCase("pp", ecfg.replace(mode="pp", topology=dataclasses.replace(topo, colocate=True),
                                                trace=True)),
             "spd-colocate": BenchCase("spd-colocate", ecfg.replace(
                 mode="spd", topology=dataclasses.replace(topo, colocate=True), trace=True)),
             "spd": BenchCase("spd", ecfg.replace(mode="spd", topology=dataclasses.replace(topo, colocate=False),
                                                  trace=True))}
    if tp > 1:  # lossless against greedy with its own split: the bench's reference for that split
        every[TP_CONFIG] = BenchCase(TP_CONFIG, ecfg.replace(mode="tp", topology=dataclasses.replace(
            one, colocate=True, tp=tp)))
    return [every[c] for c in CONFIGS + (TP_CONFIG,) if c == "ar" or c in configs]


def load_note() -> str:
    return f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}"


def run_netbench(ecfg: RunConfig, anchors: int, s: ValidationSettings, allreduce_busy_us: float = 0.0) -> dict:
    """P2P between the n + 1 ranks SPD uses, at the runtime's message sizes (a header message,
    then the payload: one activation, a stage's anchors, the last stage's exit + anchors), and
    small all-reduces for the plan's TP rows, each after `allreduce_busy_us` of compute (the tp
    row: half a shard layer, what a TP rank computes between two of its reductions); with a
    gloo or shm link also the runtime's own transport at those sizes (`--tests transport`)."""
    from spd_engine.bench.interconnect import NetbenchConfig, default_pairs, launch_local, netbench_rank

    world = max(ecfg.parallel.topology.n + 1, s.tp)  # the tp row's group is ranks 0..tp-1, as the runtime's
    itemsize = ecfg.model.torch_dtype.itemsize
    sizes = {HEADER_LEN * 8, *message_bytes(ecfg.model.cfg.hidden_size, itemsize, anchors).values()}
    tests = ("p2p", "allreduce") + (("transport",) if s.link != "p2p" else ())
    cfg = NetbenchConfig(tests=tests, sizes=tuple(sorted(sizes)), pairs=tuple(default_pairs(world)),
                         iters=s.net_iters, warmup=10, allreduce_bytes=(8, ecfg.model.cfg.hidden_size * itemsize),
                         allreduce_busy_us=allreduce_busy_us, timeout_s=s.timeout_s)
    return launch_local(netbench_rank, cfg, world, "gloo", s.timeout_s, 600 + 10 * s.timeout_s)


def predict(profile: dict, link: LinkModel, alpha: float, n: int, tokens: int | None = None, tp: int = 1,
            verify_at: str = "auto") -> dict[str, dict]:
    """Cost-model predictions per bench config: ms per tick (pp/ar/tp: per token), decode tok/s.
    `tokens`: the bench's tokens per request; SPD's tok/s then uses that request length's EAL
    (its initial fill included, `eal_for_request`) rather than the steady-state one. tp > 1: the
    plan's TP row on tp devices (its shard time from the profile's tp_layer_ms). `verify_at`: where
    the SPD runs verified, RunConfig.parallel.verify_at (a profile's stage times exclude the head either way)."""
    result = plan(Profile.from_dict(profile), Links(link), AlphaCurve({0: alpha}), [n], sim_tokens=2000,
                  verify_at=verify_at)
    rows = [r for r in result["rows"] if r["n"] == n]
    pick = lambda method, layout: next(r for r in rows if r["method"] == method and r["layout"] == layout)  # noqa: E731
    out = {"ar": {"tick_ms": result["ar_token_ms"], "tok_s": result["ar_tok_s"], "critical": "-"}}
    pp = pick("pp", "-")
    out["pp"] = {"tick_ms": pp["token_ms"], "tok_s": pp["tok_s"], "critical": "-"}
    for name, layout in (("spd-colocate", "coloc"), ("spd", "sep")):
        r = pick("spd", layout)
        assert r["partition"] == "measured", "the profile's stage times for this n must be used"
        eal = r["eal"] if tokens is None else eal_for_request(n, alpha, tokens)
        out[name] = {"tick_ms": r["tick_ms"], "tok_s": 1e3 * eal / (n * r["tick_ms"]),
                     "critical": r["critical"].split(" (")[0], "eal": eal}
    if tp > 1:
        at_tp = plan(Profile.from_dict(profile), Links(link), AlphaCurve({0: alpha}), [tp], sim_tokens=200)
        row = next(r for r in at_tp["rows"] if r["method"] == "tp" and r["n"] == tp)
        out[TP_CONFIG] = {"tick_ms": row["token_ms"], "tok_s": row["tok_s"], "critical": "-", "comm_ms": row["comm_ms"]}
    return out


def measured_of(report: dict) -> dict[str, dict]:
    """A bench report's rows as {config: {tok_s, tick_ms, world_size, alpha, eal}}."""
    out = {r["name"]: {"tok_s": r["decode_tok_s"], "tick_ms": r["tick_ms"], "world_size": r["world_size"],
                       "alpha": r["alpha"], "eal": r["eal"]} for r in report["rows"]}
    for r in report["rows"]:  # a TP row: stage 0's (TP rank 0's) collectives per token and the time inside them
        b = r.get("breakdown_ms_per_tick", {})
        if "stage0_tp_collectives" in b:
            out[r["name"]].update(tp_collectives=b["stage0_tp_collectives"], tp_collective_ms=b["stage0_tp_collective_ms"],
                                  stage_compute_ms=b["stage0_compute_ms"])
    return out


def tp_diagnostic(rounds: list[dict]) -> dict | None:
    """Where the tp row's time goes, measured (TP rank 0 of the measurement run: collectives per
    token, ms inside them, ms of compute outside them) against the model's all-reduce term;
    medians over rounds. None without a measured TP row."""
    meas = [r["measured"].get(TP_CONFIG, {}) for r in rounds]
    if not all("tp_collectives" in m for m in meas):
        return None
    inside = median(m["tp_collective_ms"] for m in meas)
    calls = median(m["tp_collectives"] for m in meas)
    return {"collectives_per_token": calls, "measured_collective_ms": inside,
            "measured_ms_per_collective": inside / calls if calls else 0.0,
            "measured_compute_outside_ms": median(m["stage_compute_ms"] - m["tp_collective_ms"] for m in meas),
            "predicted_comm_ms": median(r["predicted"][TP_CONFIG]["comm_ms"] for r in rounds)}


def compare(predicted: list[dict[str, dict]], measured: list[dict[str, dict]], tolerance: float,
            cores: int | None, same_run: list[dict[str, dict]] | None = None) -> list[dict]:
    """One row per config: medians over rounds of measured and predicted tok/s and ms per tick,
    their errors, the measured spread over rounds, and the verdict. `same_run`: the model fed
    with the measured run's own profile (a diagnostic that separates the model's error from the
    host's speed drift between runs; not a prediction)."""
    rows = []
    for name, first in measured[0].items():
        meas = [m[name] for m in measured]
        pred = [p[name] for p in predicted]
        m_tok, p_tok = median(x["tok_s"] for x in meas), median(x["tok_s"] for x in pred)
        m_tick, p_tick = median(x["tick_ms"] for x in meas), median(x["tick_ms"] for x in pred)
        err_tok, err_tick = p_tok / m_tok - 1, p_tick / m_tick - 1
        same = {}
        if same_run is not None:
            s_tick = median(x[name]["tick_ms"] for x in same_run)
            same = {"same_run_tick_ms": s_tick, "same_run_err": 100 * (s_tick / m_tick - 1)}
        rows.append({**same, "config": name, "ranks": first["world_size"], "alpha": first["alpha"], "eal": first["eal"],
                     "measured_tok_s": m_tok, "predicted_tok_s": p_tok, "tok_s_err": 100 * err_tok,
                     "measured_tick_ms": m_tick, "predicted_tick_ms": p_tick, "tick_err": 100 * err_tick,
                     "spread": f"{min(x['tok_s'] for x in meas):.2f}-{max(x['tok_s'] for x in meas):.2f}",
                     "critical": pred[0]["critical"],
                     "oversubscribed": cores is not None and first["world_size"] > cores,
                     "ok": "yes" if max(abs(err_tok), abs(err_tick)) <= tolerance else "NO"})
    return rows


def run_round(ecfg: RunConfig, prompts: Sequence[list[int]], s: ValidationSettings, k: int,
              progress: Progress) -> dict:
    """Profile run, netbench run, measurement run (fresh processes each); the predictions from
    the first two and the measurements of the third."""
    cores, cases = os.cpu_count(), bench_cases(ecfg, s.configs, s.tp, s.transport, s.verify_at)
    tag = f"# round {k + 1}/{s.rounds}"
    progress(f"{tag}, 1/3 profile run: spd bench ({', '.join(c.name for c in cases)}) ...")
    first = bench(cases, prompts, s.max_new_tokens, (), s.repeats, s.synthetic_alpha, s.seed, progress)
    prof = profile_from_bench(first, ecfg, cores, load_note())
    if s.tp > 1:
        from spd_engine.bench.tp_shard_time import shard_timing

        progress(f"{tag}, 1/3 profile run: TP shard step times, {s.tp} shards at once, in lockstep ...")
        # lockstep: the shards with their real all-reduces: compute per layer and the all-reduce between
        shards = shard_timing(ecfg, s.tp, s.tp_steps, lockstep=True)
        prof["tp_layer_ms"] = {str(s.tp): shards["layer_ms"]}
        prof["tp_allreduce_ms"] = {str(s.tp): shards["allreduce_ms"]}
    progress(f"{tag}, 2/3 netbench run: P2P at the runtime's message sizes ...")
    busy_us = 1e3 * prof["tp_layer_ms"][str(s.tp)] / 2 if s.tp > 1 else 0.0
    net = run_netbench(ecfg, prof["anchors_per_stage"], s, busy_us)
    progress(f"{tag}, 3/3 measurement run: spd bench again ...")
    second = bench(cases, prompts, s.max_new_tokens, (), s.repeats, s.synthetic_alpha, s.seed, progress)
    for name, run in (("profile", first), ("measurement", second)):
        if run["mismatches"]:
            raise RuntimeError(f"{name} run: outputs differ from ar for {run['mismatches']}")
    own = profile_from_bench(second, ecfg, cores, load_note())  # diagnostic only, see compare()
    if s.tp > 1:
        own["tp_layer_ms"] = prof["tp_layer_ms"]  # no shard timing inside the measurement run
        own["tp_allreduce_ms"] = prof["tp_allreduce_ms"]
    for run in (first, second):
        for key in ("traces", "request_traces"):
            run.pop(key, None)  # large; the profiles keep what the model needs
    rnd = {"profile": prof, "netbench": net, "alpha": prof["source"]["alpha_measured"],
           "measured": measured_of(second), "measurement_profile": own, "profile_run": first,
           "measurement_run": second, "load": load_note()}
    return {**rnd, **predict_round(rnd, ecfg.parallel.topology.n, s)}


def predict_round(rnd: dict, n: int, s: ValidationSettings) -> dict:
    """A round's predictions (from its profile run + netbench run) and the same-run diagnostic
    (from its measurement run's own profile)."""
    link = LinkModel.from_netbench(rnd["netbench"], "netbench (this host)", s.latency_stat, s.link)
    own = rnd["measurement_profile"]
    return {"predicted": predict(rnd["profile"], link, rnd["alpha"], n, s.max_new_tokens, s.tp, s.verify_at),
            "same_run": predict(own, link, own["source"]["alpha_measured"], n, s.max_new_tokens, s.tp, s.verify_at)}


def repredict(result: dict) -> dict:
    """A saved validation (`--json` of --validate-runtime) with every round predicted again by
    the current cost model from the same measured inputs; the measurements are unchanged."""
    # files saved before verify_at existed were measured with the driver verifying (and their
    # profiles' stage times exclude the head, as the model wants)
    s = ValidationSettings(**{"verify_at": "driver", **result["settings"],
                              "configs": tuple(result["settings"]["configs"])})
    rounds = [{**r, **predict_round(r, result["n"], s)} for r in result["rounds"]]
    cores = result.get("cores") or int(result["host"]["before"].split()[0])  # older files: from the load note
    rows = compare([r["predicted"] for r in rounds], [r["measured"] for r in rounds], s.tolerance, cores,
                   [r["same_run"] for r in rounds])
    return {**result, "rows": rows, "rounds": rounds, "cores": cores, "repredicted": True,
            "settings": {**result["settings"], "verify_at": s.verify_at},
            "tp_diagnostic": tp_diagnostic(rounds)}


def validate(ecfg: RunConfig, prompts: Sequence[list[int]], s: ValidationSettings,
             progress: Progress = lambda m: None) -> dict:
    """`rounds` rounds of profile run + netbench run + measurement run; medians over rounds of
    predictions and measurements are compared (they damp other jobs' load swings on a shared host)."""
    bench_cases(ecfg, s.configs, s.tp, s.transport, s.verify_at)  # bad configs fail before anything starts
    load_before = load_note()
    rounds = [run_round(ecfg, prompts, s, k, progress) for k in range(s.rounds)]
    rows = compare([r["predicted"] for r in rounds], [r["measured"] for r in rounds], s.tolerance, os.cpu_count(),
                   [r["same_run"] for r in rounds])
    return {"rows": rows, "rounds": rounds, "profile": rounds[0]["profile"], "tp_diagnostic": tp_diagnostic(rounds),
            "alpha_used": [r["alpha"] for r in rounds], "host": {"before": load_before,
                                                                 **{f"after round {k + 1}": r["load"]
                                                                    for k, r in enumerate(rounds)}},
            "settings": dataclasses.asdict(s), "n": ecfg.parallel.topology.n, "cores": os.cpu_count(),
            "model": ecfg.model.source, "head": ecfg.drafting.pdm,
            "threads_per_rank": ecfg.threads_per_rank()}


_VERIFY_LABELS = {"last": "last stage (--verify-at last)", "driver": "driver (--verify-at driver)",
                  "auto": "last stage co-located, on the driver with a rank of its own (--verify-at auto)"}
_LINK_LABELS = {"p2p": "raw gloo P2P, runs on gloo", "gloo": "the gloo frame transport, runs on gloo",
                "shm": "the shared-memory rings, runs on shm"}


def format_validation(result: dict) -> str:
    from spd_engine.bench.stats import format_table

    s = result["settings"]
    label = (f"SYNTHETIC acceptance alpha={s['synthetic_alpha']}" if s["synthetic_alpha"] is not None
             else f"head {result['head']}")
    lines = [f"# runtime validation: {result['model']}, n={result['n']}, {result['threads_per_rank']} thread(s) per "
             f"rank, {s['max_new_tokens']} tokens per prompt, {label}",
             f"# medians over {s['rounds']} rounds of: profile run + netbench run -> prediction; an independent "
             f"bench run -> measurement; hops: {_LINK_LABELS[s.get('link', 'p2p')]}; SPD verifies on the "
             f"{_VERIFY_LABELS[s.get('verify_at', 'driver')]}",
             format_table(result["rows"], [
                 ("config", "config", ""), ("ranks", "ranks", ""), ("measured_tok_s", "meas tok/s", ".2f"),
                 ("spread", "rounds min-max", ""), ("predicted_tok_s", "pred tok/s", ".2f"),
                 ("tok_s_err", "err%", "+.1f"),
                 ("measured_tick_ms", "meas ms/tick", ".2f"), ("predicted_tick_ms", "pred ms/tick", ".2f"),
                 ("tick_err", "err%", "+.1f"), ("same_run_tick_ms", "same-run ms/tick", ".2f"),
                 ("same_run_err", "err%", "+.1f"), ("alpha", "alpha", ".3f"), ("critical", "critical path", ""),
                 ("ok", f"within {100 * s['tolerance']:g}%", "")])]
    bad = [r["config"] for r in result["rows"] if r["ok"] != "yes"]
    over = [f"{r['config']} ({r['ranks']} ranks)" for r in result["rows"] if r["oversubscribed"]]
    lines.append(f"{len(result['rows']) - len(bad)} of {len(result['rows'])} configs within "
                 f"{100 * s['tolerance']:g}% (tok/s and ms/tick)" + (f"; off: {', '.join(bad)}" if bad else ""))
    if over:
        lines.append(f"oversubscribed (more ranks than the host's {result['cores']} cores): {', '.join(over)}")
    lines.append("ar: predicted = the profile runs' AR time (layer_ms is derived from it), so its row "
                 "measures run-to-run reproducibility")
    lines.append("same-run: the model fed with the measured run's own profile (a diagnostic, not a prediction): "
                 "it separates the model's error from the host's speed drift between runs")
    tpd = result.get("tp_diagnostic")
    if tpd:
        lines.append(f"tp row, TP rank 0 of the measurement run: {tpd['collectives_per_token']:g} collectives per token, "
                     f"{tpd['measured_collective_ms']:.2f} ms inside them ({tpd['measured_ms_per_collective']:.3f} ms each: "
                     f"transfer + waiting for the slower shard), {tpd['measured_compute_outside_ms']:.2f} ms of compute "
                     f"outside them; the model's all-reduce + hop term: {tpd['predicted_comm_ms']:.2f} ms")
    lines.append("host load: " + "; ".join(f"{k}: {v}" for k, v in result["host"].items()))
    return "\n".join(lines)

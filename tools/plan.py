"""`spd plan`: predict SPD tick time, tokens/s and speedup against TP, PP and TP x SPD hybrids
from a compute profile, netbench link measurements and an acceptance alpha (and, given its
acceptance, the serial eagle baseline on one device: costmodel/cost_eagle.py); or, with
`--validate`, check the model against tick replays with sleeping stages on this host; or, with
`--validate-runtime`, against real ar / pp / SPD runs (bench/validate_runtime.py).
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from statistics import median
from typing import TYPE_CHECKING

from spd_engine.bench.stats import format_table
from spd_engine.costmodel.cost_inputs import REFERENCE_PROFILES, AlphaCurve, LinkModel, Profile
from spd_engine.costmodel.cost_model import Links, plan, recommendation
from spd_engine.costmodel.cost_model_spd import VERIFY_AT, predict_replay, verifies_on_last

DEFAULT_WIDTH_COST = "2:1.0,4:1.0,8:1.0"  # an assumption, labelled wherever it is used

if TYPE_CHECKING:  # the runtime's config imports torch; the plan itself does not need it
    from spd_engine.engine.runtime.run_config import RunConfig


def add_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_argument_group("compute (schema spd-profile/1, docs/benchmarks.md)")
    src.add_argument("--profile", help="profile JSON: layer_ms, pdm_ms, verify_ms, hidden_size, ...")
    src.add_argument("--reference", choices=sorted(REFERENCE_PROFILES), help="a built-in H200 profile (docs/design.md 6)")
    net = p.add_argument_group("links (netbench JSON, or explicit assumptions flagged in the output)")
    net.add_argument("--net", help="netbench JSON for links inside a node (or all links)")
    net.add_argument("--net-inter", help="netbench JSON for links between nodes")
    net.add_argument("--gpus-per-node", type=int, help="devices per node (needed with --net-inter)")
    net.add_argument("--assume-link", help="LAT_US,GBPS[,ALLREDUCE_US] instead of --net (an assumption)")
    net.add_argument("--assume-inter", help="LAT_US,GBPS[,ALLREDUCE_US] instead of --net-inter (an assumption)")
    net.add_argument("--latency-stat", default="idle_mean_us",
                     choices=("idle_mean_us", "idle_p50_us", "mean_us", "p50_us", "p90_us"),
                     help="netbench statistic used as hop time (default: mean one-way time to an idle peer)")
    net.add_argument("--net-transport", default="p2p", choices=("p2p", "gloo", "shm"),
                     help="which netbench rows give the hops: raw P2P, or the runtime's own transport "
                          "(`--tests transport` rows: gloo frames or the shared-memory rings, whose one-way "
                          "time holds both ends' copies); with --validate-runtime also what its runs use")
    net.add_argument("--net-busy-mb", type=float, default=0.0,
                     help="with --net-transport gloo/shm: the rows measured after this many MiB of weight "
                          "streaming on both ends (`--busy-mb`), the hop a computing CPU rank meets")
    acc = p.add_argument_group("acceptance")
    acc.add_argument("--alpha", help="one alpha (0.8) or per n (2:0.9,4:0.85,8:0.8)")
    acc.add_argument("--alpha-json", help="eval JSON with alpha_by_n or results[{n, alpha}]")
    acc.add_argument("--eagle-alpha", type=float, help="eagle baseline row: per-draft acceptance (i.i.d. drafts)")
    acc.add_argument("--eagle-json", help="eagle baseline row: `spd eval --mode eagle --json` (its acceptance length)")
    acc.add_argument("--eagle-k", type=int, help="eagle drafts per round (default: the eval's k, or the best k in 1..8)")
    br = p.add_argument_group("branch width W (PREDICTED from the exact replay's EAL and a W-row step cost)")
    br.add_argument("--branches-json", help="spd draft-policies --branches --json report: EAL and stage tokens "
                                            "per step for each W, at its n")
    br.add_argument("--branch-policy", default="refill suffix>=2", help="branch rule and chooser of the report rows")
    br.add_argument("--width-cost", default=DEFAULT_WIDTH_COST,
                    help="W:RATIO, a W-token stage step's time over a one-token step's, for branch chains and "
                         "--batch rows (default ASSUMED 1.0: memory-bound GPU decode; spd measure stage-width-time "
                         "measures it)")
    bt = p.add_argument_group("several requests in the pipeline (PREDICTED from the tick protocol's replay and a "
                              "B-row step cost, docs/design.md 3.12)")
    bt.add_argument("--batch", help="request counts B, e.g. 1,2,4,8: throughput over all requests and per-request "
                                    "TPOT at each n of --n, a B-row stage step priced with --width-cost")
    bt.add_argument("--batch-requests", type=int, default=32,
                    help="requests the replay plays at every B (the same ones, seeded with --seed)")
    bt.add_argument("--batch-tokens", type=int, default=128, help="tokens of each replayed request")
    p.add_argument("--verify-at", choices=VERIFY_AT, default="auto",
                   help="where SPD verifies at T=0, as the runtime's --verify-at: on the last stage (its compute "
                        "holds the head), on the driver, or auto (last co-located, driver with a separate driver); "
                        "with --validate-runtime also where its SPD runs verify")
    p.add_argument("--n", default="2-16", help="stage counts, e.g. 2-16 or 2,4,8")
    p.add_argument("--sim-tokens", type=int, default=1000, help="decode tokens simulated per configuration")
    p.add_argument("--seed", type=int, default=0, help="seed of the simulated accept/reject draws and replays")
    p.add_argument("--details", action="store_true", help="print every configuration, not just the best per n")
    p.add_argument("--json", help="write the full result here")
    p.add_argument("--schedule-figure", metavar="SVG", default=None,
                   help="write the worked example's tick schedule (n = 4, one rejection; README.md's figure) as SVG "
                        "and exit")
    p.add_argument("--results-figure", metavar="SVG", default=None,
                   help="draw the results figure (EAL by n, speed rows against ar, the ceiling) from --results-from "
                        "as SVG and exit; README.md's: --results-from docs/figures/results.json")
    p.add_argument("--results-from", metavar="JSON[,JSON...]", default=None,
                   help="--results-figure's inputs: spd eval --json and spd bench --json reports, or figure-data "
                        "files (format spd-results/1, bench/results_plot.py)")
    val = p.add_argument_group("validation (--validate)")
    val.add_argument("--validate", action="store_true", help="run tick replays here and compare with the model")
    val.add_argument("--tolerance", type=float, default=0.15, help="allowed relative tick-time error")
    val.add_argument("--repeats", type=int, default=3, help="rounds of every replay scenario (medians are compared)")
    val.add_argument("--timeout", type=float, default=30.0, help="receive timeout of the replay ranks")
    val.add_argument("--nice", type=int, default=0,
                     help="niceness added to every rank, e.g. -10 on a busy shared host (needs privileges)")
    rt = p.add_argument_group("validation against the real runtime (--validate-runtime; also uses --repeats as "
                              "rounds, --tolerance, --timeout, --nice, --seed, --latency-stat, --json)")
    rt.add_argument("--validate-runtime", action="store_true",
                    help="profile run + netbench run -> predictions; compared with an independent bench run")
    rt.add_argument("--model", default="smollm2-135m", help="model for --validate-runtime (spd bench --model)")
    rt.add_argument("--spec", default=None, help="PDM head for --validate-runtime (default: shipped head or random)")
    rt.add_argument("--stages", type=int, default=2, help="n for --validate-runtime")
    rt.add_argument("--threads", type=int, default=1, help="torch threads per rank for --validate-runtime")
    rt.add_argument("--tp", type=int, default=1,
                    help="with --validate-runtime: also a tp row (--mode tp over this many ranks), predicted from "
                         "TP shard step times measured on this host and netbench all-reduces over the same groups")
    rt.add_argument("--synthetic-alpha", default="0.8",
                    help="synthetic acceptance for --validate-runtime (labelled), or 'none' for the head's drafts")
    rt.add_argument("--max-new-tokens", type=int, default=48, help="tokens per prompt for --validate-runtime")
    rt.add_argument("--prompt", action="append", help="prompt(s) for --validate-runtime (default: three built-in)")
    rt.add_argument("--profile-out", help="with --validate-runtime: also write the profile run's spd-profile/1 here")
    rt.add_argument("--revalidate", metavar="JSON",
                    help="a saved --validate-runtime --json: predict its rounds again with this cost model from the "
                         "same measured inputs (runs nothing; uses --tolerance, --json)")


def _load_json(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def assumed_link(text: str, name: str) -> LinkModel:
    try:
        parts = [float(x) for x in text.split(",")]
    except ValueError:
        raise ValueError(f"{name} must be LAT_US,GBPS[,ALLREDUCE_US], got {text!r}") from None
    if len(parts) not in (2, 3) or parts[0] < 0 or parts[1] <= 0:
        raise ValueError(f"{name} must be LAT_US,GBPS[,ALLREDUCE_US] with positive bandwidth, got {text!r}")
    label = f"{parts[0]:g} us, {parts[1]:g} GB/s" + (f", all-reduce {parts[2]:g} us" if len(parts) == 3 else "")
    return LinkModel.assume(label, parts[0], parts[1], parts[2] if len(parts) == 3 else None)


def _links(args: argparse.Namespace) -> Links:
    if args.net:
        intra = LinkModel.from_netbench(_load_json(args.net), args.net, args.latency_stat, args.net_transport,
                                        args.net_busy_mb)
    elif args.assume_link:
        intra = assumed_link(args.assume_link, "--assume-link")
    else:
        raise ValueError("give link numbers: --net NETBENCH.json (measured) or --assume-link LAT_US,GBPS")
    inter = None
    if args.net_inter:
        inter = LinkModel.from_netbench(_load_json(args.net_inter), args.net_inter, args.latency_stat)
    elif args.assume_inter:
        inter = assumed_link(args.assume_inter, "--assume-inter")
    if (args.net_transport != "p2p" or args.net_busy_mb) and not args.net:
        raise ValueError("--net-transport / --net-busy-mb select rows of --net NETBENCH.json")
    if inter is not None and not args.gpus_per_node:
        raise ValueError("--net-inter / --assume-inter need --gpus-per-node")
    return Links(intra, inter, args.gpus_per_node)


def _alpha(args: argparse.Namespace) -> AlphaCurve:
    if args.alpha_json:
        return AlphaCurve.from_eval_json(_load_json(args.alpha_json))
    if not args.alpha:
        raise ValueError("give --alpha or --alpha-json")
    try:
        if ":" not in args.alpha:
            return AlphaCurve({0: float(args.alpha)})
        return AlphaCurve({int(k): float(v) for k, v in (item.split(":") for item in args.alpha.split(","))})
    except ValueError as err:
        raise ValueError(f"--alpha: {err}") from None


def _eagle(args: argparse.Namespace):
    """EagleInputs from --eagle-alpha / --eagle-json, or None (no eagle row)."""
    from spd_engine.costmodel.cost_eagle import EagleInputs, eagle_inputs_from_eval

    if args.eagle_alpha is not None and args.eagle_json:
        raise ValueError("give --eagle-alpha or --eagle-json, not both")
    if args.eagle_json:
        return eagle_inputs_from_eval(_load_json(args.eagle_json), args.eagle_k)
    if args.eagle_alpha is not None:
        return EagleInputs(alpha=args.eagle_alpha, k=args.eagle_k)
    if args.eagle_k is not None:
        raise ValueError("--eagle-k needs --eagle-alpha or --eagle-json")
    return None


def print_eagle(row: dict) -> None:
    print(f"\n# eagle (serial draft-then-verify, one device, {row['source']}): k={row['k']}, acceptance length "
          f"{row['acceptance_length']:.2f} per round of {row['round_ms']:.3f} ms ({row['k']} x "
          f"{row['draft_step_ms']:.3f} ms draft steps + {row['target_pass_ms']:.3f} ms target pass): "
          f"{row['tok_s']:.1f} tok/s, {row['speedup_vs_ar']:.2f}x AR")


def _ns(text: str) -> list[int]:
    try:
        if "-" in text:
            lo, hi = (int(x) for x in text.split("-"))
            ns = list(range(lo, hi + 1))
        else:
            ns = [int(x) for x in text.split(",")]
    except ValueError:
        raise ValueError(f"--n must look like 2-16 or 2,4,8, got {text!r}") from None
    if not ns or min(ns) < 2:
        raise ValueError("--n values must be >= 2")
    return ns


def _winner(r: dict) -> str:
    """A configuration in the summary's last column: pp, tp, spd LAYOUT, or tpT x spdN LAYOUT."""
    if r["method"] in ("pp", "tp"):
        return r["method"]
    if r["method"] == "spd":
        return f"spd {r['layout']}"
    return f"tp{r['tp']} x spd{r['spd_stages']} {r['layout']}"


def _summary_rows(result: dict) -> list[dict]:
    rows = []
    for n in sorted({r["n"] for r in result["rows"]}):
        at = [r for r in result["rows"] if r["n"] == n]
        best = lambda pred: max((r for r in at if pred(r)), key=lambda r: r["tok_s"], default=None)  # noqa: E731
        sep = best(lambda r: r["method"] == "spd" and r["layout"] == "sep")
        col = best(lambda r: r["method"] == "spd" and r["layout"] == "coloc")
        hyb = best(lambda r: r["method"].endswith("xspd") and r["layout"] == "coloc")
        pp = best(lambda r: r["method"] == "pp")
        tp = best(lambda r: r["method"] == "tp")
        # resource-matched, as the recommendation: every configuration on exactly n devices, whatever
        # its stage count (TP2 x SPD6 sep uses 13), not only those of this row's n
        same = max((r for r in result["rows"] if r["devices"] == n), key=lambda r: r["tok_s"])
        rows.append({"n": n, "ar": result["ar_tok_s"], "pp": pp["tok_s"], "tp": tp["tok_s"],
                     "coloc": col["tok_s"], "coloc_tick": col["tick_ms"], "coloc_crit": col["critical"].split(" (")[0],
                     "eal": col["eal"], "sep": sep["tok_s"],
                     "hyb": f"{hyb['tok_s']:.1f} (tp{hyb['tp']})" if hyb else "-",
                     "winner": _winner(same)})
    return rows


_VERIFY_WHERE = {"last": "last stage", "driver": "driver",
                 "auto": "last stage co-located, on the driver with a separate driver"}


def print_plan(result: dict, details: bool) -> None:
    links = result["links"]
    inter = f"; between nodes: {links['inter']}, {links['gpus_per_node']} devices per node" if links["inter"] else ""
    print(f"# spd plan: {result['profile']}; links: {links['intra']}{inter}")
    print("# decode tok/s; AR = one device; SPD coloc / PP / TP / hybrid on n devices, SPD sep on n+1; SPD "
          f"verifies at T=0 on the {_VERIFY_WHERE[result['verify_at']]} (--verify-at {result['verify_at']})")
    print(format_table(_summary_rows(result), [
        ("n", "n", ""), ("ar", "AR", ".1f"), ("pp", "PP", ".1f"), ("tp", "TP", ".1f"),
        ("coloc", "SPD coloc", ".1f"), ("coloc_tick", "tick(ms)", ".3f"), ("eal", "EAL", ".2f"),
        ("coloc_crit", "critical path", ""), ("sep", "SPD sep(n+1)", ".1f"), ("hyb", "TPxSPD", ""),
        ("winner", "best on n devices", "")]))
    if details:
        rows = [{**r, "layers": ",".join(map(str, r.get("stage_layers") or [])) or "-"} for r in result["rows"]]
        print()
        print(format_table(rows, [
            ("n", "n", ""), ("method", "method", ""), ("layout", "layout", ""), ("partition", "split", ""),
            ("layers", "stage layers", ""), ("devices", "devices", ""), ("tick_ms", "tick(ms)", ".3f"),
            ("eal", "EAL", ".2f"), ("token_ms", "ms/token", ".3f"), ("tok_s", "tok/s", ".1f"),
            ("speedup_vs_ar", "vs AR", ".2f"), ("driver_slack_ms", "slack(ms)", ".3f"),
            ("critical", "critical path", "")]))
    print("\nrecommendation:")
    for line in result["recommendation"]:
        print(f"  - {line}")
    if result["notes"]:
        print("notes:")
        for line in result["notes"]:
            print(f"  - {line}")


def _validate(args: argparse.Namespace) -> int:
    """Rounds of: a netbench P2P run at the replay's message sizes, then every replay scenario,
    in one launch. Each round's replays are predicted from that round's netbench numbers (or
    from --net for all rounds); medians over rounds are compared."""
    from spd_engine.bench.interconnect import NetbenchConfig, launch_local, netbench_rank
    from spd_engine.bench.tick_replay import VALIDATION_SCENARIOS, validation_message_sizes

    world = max(sc.ranks_needed() for sc in VALIDATION_SCENARIOS)
    count = len(VALIDATION_SCENARIOS)
    given = _load_json(args.net) if args.net else None
    tests = ("replay",) if given else ("p2p", "replay")
    cfg = NetbenchConfig(tests=tests, sizes=validation_message_sizes(), pairs=((0, 1), (0, 2), (1, 2)), iters=200,
                         warmup=20, replay=list(VALIDATION_SCENARIOS), timeout_s=args.timeout)
    rounds = []
    load_before = os.getloadavg()[0]
    for k in range(args.repeats):
        print(f"# round {k + 1}/{args.repeats}: " + ("" if given else "netbench P2P, then ")
              + f"{count} tick replays on {world} ranks ...", flush=True)
        report = launch_local(netbench_rank, cfg, world, "gloo", args.timeout, 1200, args.nice)
        net = given or {key: v for key, v in report.items() if key != "tick_replay"}
        rounds.append((LinkModel.from_netbench(net, args.net or "netbench", args.latency_stat), net,
                       report["tick_replay"]))
    rows = []
    for i in range(count):  # medians over the rounds damp other jobs' load spikes on a shared host
        runs = [(link, replays[i]) for link, _, replays in rounds]
        r = runs[0][1]
        measured = median(x["tick_ms"] for _, x in runs)
        nominal = median(predict_replay(x, link, profiled=False)["tick_ms"] for link, x in runs)
        profiled = median(predict_replay(x, link, profiled=True)["tick_ms"] for link, x in runs)
        link = runs[0][0]
        error = profiled / measured - 1
        rows.append({"n": r["n"], "layout": "coloc" if r["colocate"] else "sep",
                     "stages": ",".join(f"{c:g}" for c in r["stage_ms"]), "pdm": r["pdm_ms"], "verify": r["verify_ms"],
                     "alpha": r["alpha"], "ticks": r["ticks"], "measured": measured,
                     "nominal": nominal, "nominal_err": 100 * (nominal / measured - 1),
                     "profiled": profiled, "profiled_err": 100 * error,
                     "critical": predict_replay(r, link, profiled=True)["critical"].split(" (")[0],
                     "ok": "yes" if abs(error) <= args.tolerance else "NO"})
    print(f"# tick ms, median of {args.repeats} rounds: measured by the replay; predicted from the separate")
    print("# netbench link numbers with the configured compute (nominal) or the compute durations the")
    print("# stages measured (profiled, what a profile of real stages gives)")
    print(format_table(rows, [
        ("n", "n", ""), ("layout", "layout", ""), ("stages", "stage ms", ""), ("pdm", "pdm", ".2f"),
        ("verify", "verify", ".2f"), ("alpha", "alpha", ".2f"), ("ticks", "ticks", ""),
        ("measured", "measured", ".3f"), ("nominal", "nominal", ".3f"), ("nominal_err", "err%", "+.1f"),
        ("profiled", "profiled", ".3f"), ("profiled_err", "err%", "+.1f"), ("critical", "critical path", ""),
        ("ok", f"within {100 * args.tolerance:g}%", "")]))
    bad = sum(r["ok"] != "yes" for r in rows)
    host = f"{os.cpu_count()} cores, load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after"
    print(f"\n{len(rows) - bad} of {len(rows)} scenarios within {100 * args.tolerance:g}% (profiled compute); "
          f"host: {host}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "host": host,
                       "rounds": [{"netbench": net, "replays": rep} for _, net, rep in rounds]}, f, indent=1)
    return 1 if bad else 0


VALIDATION_PROMPTS = ("Write a short story about a robot who learns to paint.",
                      "Explain how a bicycle stays upright, step by step.",
                      "List ten ideas for a rainy weekend and say why each is fun.")


def _runtime_config(args: argparse.Namespace) -> tuple[RunConfig, Path | None]:
    """(the RunConfig of --validate-runtime's SPD runs, tokenizer directory or None): --model on
    --stages stages with --spec (default: the shipped head for that n, else an untrained one),
    --threads per rank, --seed; receives inside a request wait at least a minute."""
    from spd_engine.engine.protocol.topology import Topology
    from spd_engine.engine.runtime.run_config import Drafting, ModelSpec, ParallelLayout, RunConfig, Runtime
    from spd_engine.tools.model_args import default_head, model_config, resolve_model

    engine_spec, tok_dir = resolve_model(args.model)
    cfg = model_config(engine_spec)
    topo = Topology.build(cfg.num_layers, n=args.stages)
    ecfg = RunConfig(model=ModelSpec(source=engine_spec, cfg=cfg),
                     parallel=ParallelLayout(topology=topo, threads=args.threads),
                     # branches=1: the runtime the cost model's SPD row prices (W > 1: costmodel/cost_branches.py)
                     drafting=Drafting(pdm=args.spec or default_head(args.model, topo.n), branches=1),
                     runtime=Runtime(seed=args.seed, timeout_s=max(args.timeout, 60.0),
                                     capacity=min(Runtime.capacity, cfg.max_position)))
    return ecfg, tok_dir


def _validate_runtime(args: argparse.Namespace) -> int:
    """Cost model vs the real runtime (bench/validate_runtime.py); exit status 1 if a config is
    off by more than --tolerance."""
    import sys

    from spd_engine.bench.validate_runtime import CONFIGS, ValidationSettings, format_validation, validate
    from spd_engine.engine.model.tokenizer import Tokenizer
    from spd_engine.engine.runtime.request_inputs import encode_prompts

    alpha = None if args.synthetic_alpha.lower() == "none" else float(args.synthetic_alpha)
    if alpha is not None and not 0 <= alpha <= 1:
        raise ValueError(f"--synthetic-alpha must be in [0, 1] or 'none', got {args.synthetic_alpha}")
    if args.stages < 2 or args.threads < 1 or args.max_new_tokens < 2 or args.repeats < 1:
        raise ValueError("--validate-runtime needs --stages >= 2, --threads >= 1, --max-new-tokens >= 2, "
                         "--repeats >= 1")
    ecfg, tok_dir = _runtime_config(args)
    tok = Tokenizer.from_dir(tok_dir) if tok_dir is not None else None
    prompts = encode_prompts(list(args.prompt or VALIDATION_PROMPTS), tok, True, ecfg.model.cfg.vocab_size)
    if args.nice:
        os.nice(args.nice)  # inherited by every rank this process starts
    from spd_engine.engine.model.tp_shard import check_tp

    if args.tp > 1:
        check_tp(ecfg.model.cfg, args.tp)
    settings = ValidationSettings(max_new_tokens=args.max_new_tokens, rounds=args.repeats, synthetic_alpha=alpha,
                                  seed=args.seed, tolerance=args.tolerance, latency_stat=args.latency_stat,
                                  timeout_s=max(args.timeout, 60.0), tp=args.tp,
                                  configs=CONFIGS + (("tp",) if args.tp > 1 else ()), link=args.net_transport,
                                  verify_at=args.verify_at)
    result = validate(ecfg, prompts, settings, lambda m: print(m, file=sys.stderr, flush=True))
    print(format_validation(result))
    if args.profile_out:
        with open(args.profile_out, "w") as f:
            json.dump(result["profile"], f, indent=1)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 1 if any(r["ok"] != "yes" for r in result["rows"]) else 0


def _revalidate(args: argparse.Namespace) -> int:
    from spd_engine.bench.validate_runtime import format_validation, repredict

    saved = _load_json(args.revalidate)
    if not isinstance(saved, dict) or not saved.get("rounds") or "settings" not in saved:
        raise ValueError(f"{args.revalidate}: not a --validate-runtime JSON (no rounds/settings)")
    saved["settings"]["tolerance"] = args.tolerance
    try:
        result = repredict(saved)
    except (KeyError, TypeError) as err:
        raise ValueError(f"{args.revalidate}: incomplete --validate-runtime JSON (missing or bad {err})") from None
    print(format_validation(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 1 if any(r["ok"] != "yes" for r in result["rows"]) else 0


def _branches(args: argparse.Namespace, profile: Profile, links: Links) -> dict:
    """Predicted rows for each W of a draft-policies report (costmodel/cost_branches.py), printed."""
    from spd_engine.costmodel.cost_branches import branch_rows, parse_width_cost, read_branch_report

    report = _load_json(args.branches_json)
    measured = read_branch_report(report, args.branch_policy)
    n, cost, notes = int(report["n"]), parse_width_cost(args.width_cost), []
    out = {"n": n, "policy": args.branch_policy, "width_cost": cost, "source": args.branches_json, "rows": {}}
    for colocate in (False, True):
        rows = branch_rows(profile, links.of_devices, n, colocate, measured, cost, notes,
                           verifies_on_last(args.verify_at, colocate))
        for r in rows:
            r["x_w1"] = r["tok_s"] / rows[0]["tok_s"]
        out["rows"]["coloc" if colocate else "sep"] = rows
        print(f"\nbranch width at n={n}, {'co-located' if colocate else 'separate'} driver, {args.branch_policy} "
              f"(PREDICTED: EAL and tokens per step from the offline replay {args.branches_json}; W-token step "
              f"cost {args.width_cost}{' ASSUMED' if args.width_cost == DEFAULT_WIDTH_COST else ''}):")
        print(format_table(rows, [("W", "W", ""), ("eal", "EAL", ".3f"), ("tokens_per_step", "tok/step", ".2f"),
                                  ("tick_ms", "tick ms", ".3f"), ("tok_s", "tok/s", ".1f"), ("x_w1", "x W=1", ".3f")]))
    out["notes"] = notes
    return out


def _batch(args: argparse.Namespace, profile: Profile, links: Links, alpha: AlphaCurve) -> dict:
    """Predicted rows for each B of --batch at each n (costmodel/cost_batch.py), printed."""
    from spd_engine.costmodel.cost_batch import batch_rows, parse_batches, replay_batch
    from spd_engine.costmodel.cost_branches import parse_width_cost

    batches, cost, notes = parse_batches(args.batch), parse_width_cost(args.width_cost), []
    assumed = " ASSUMED" if args.width_cost == DEFAULT_WIDTH_COST else ""
    out = {"batches": batches, "width_cost": cost, "rows": [], "predicted": True}
    for n in _ns(args.n):
        if n > profile.num_layers:
            continue
        a = alpha(n, notes)
        replays = {b: replay_batch(n, b, a, args.batch_requests, args.batch_tokens, args.seed)
                   for b in batches}  # the same for both layouts
        for colocate in (False, True):
            rows = batch_rows(profile, links.of_devices, n, a, batches, colocate, cost, notes,
                              verifies_on_last(args.verify_at, colocate), replays)
            out["rows"] += rows
            print(f"\nseveral requests at n={n}, {'co-located' if colocate else 'separate'} driver (PREDICTED: the "
                  f"tick protocol's replay at alpha {a:g}, the same {args.batch_requests} requests of "
                  f"{args.batch_tokens} tokens at every B, even split; B-row step cost {args.width_cost}{assumed}):")
            print(format_table(rows, [
                ("B", "B", ""), ("rows_per_step", "rows/step", ".2f"), ("utilization", "stage util", ".3f"),
                ("tick_ms", "tick ms", ".3f"), ("tok_s", "tok/s (all)", ".1f"), ("tok_s_x", f"x B={batches[0]}", ".2f"),
                ("tpot_ms", "TPOT ms", ".3f"), ("tpot_x", f"x B={batches[0]}", ".2f")]))
    if notes:
        print("notes:")
        for line in notes:
            print(f"  - {line}")
    out["notes"] = notes
    return out


def run(args: argparse.Namespace) -> int:
    if (args.results_figure is None) != (args.results_from is None):
        raise ValueError("--results-figure and --results-from go together: the figure and the reports it is drawn from")
    if args.results_figure:
        from spd_engine.bench.results_plot import plot_results

        plot_results([f for f in args.results_from.split(",") if f], args.results_figure)
        return 0
    if args.schedule_figure:
        from pathlib import Path

        from spd_engine.bench.schedule_figure import worked_example_svg

        out = Path(args.schedule_figure)
        tmp = out.with_name(out.name + ".tmp")  # written whole or not at all
        tmp.write_text(worked_example_svg())
        tmp.replace(out)
        return 0
    if sum(map(bool, (args.validate, args.validate_runtime, args.revalidate))) > 1:
        raise ValueError("give one of --validate (tick replays), --validate-runtime (real runs) and --revalidate")
    if (args.validate or args.revalidate) and (args.net_transport != "p2p" or args.net_busy_mb):
        raise ValueError("--net-transport / --net-busy-mb price a plan or --validate-runtime's runs; "
                         "--validate and --revalidate use what they measured")
    if args.validate or args.revalidate:
        from spd_engine.tools.cli_conventions import refuse_ignored  # imports the runtime's config (torch), as these do

        refuse_ignored(args, ["verify_at"], "by --validate (its tick replays verify on the driver) or --revalidate "
                                            "(it prices its saved runs as they verified)")
    if (args.validate or args.validate_runtime or args.revalidate) and args.batch:
        raise ValueError("--batch prices a plan; --validate, --validate-runtime and --revalidate run one request "
                         "at a time")
    if args.validate_runtime and args.net_busy_mb:
        raise ValueError("--net-busy-mb prices a plan; --validate-runtime measures its hops between idle ranks")
    if args.revalidate:
        return _revalidate(args)
    if args.validate_runtime:
        return _validate_runtime(args)
    if args.validate:
        return _validate(args)
    if bool(args.profile) == bool(args.reference):
        raise ValueError("give exactly one of --profile PROFILE.json and --reference NAME")
    if args.profile:
        profile = Profile.from_dict(_load_json(args.profile))
    else:
        profile = Profile.from_dict({**REFERENCE_PROFILES[args.reference], "name": args.reference})
    eagle = _eagle(args)
    links = _links(args)
    alpha = _alpha(args)
    result = plan(profile, links, alpha, _ns(args.n), args.sim_tokens, args.seed, args.verify_at)
    result["recommendation"] = recommendation(result)
    print_plan(result, args.details)
    if eagle is not None:
        from spd_engine.costmodel.cost_eagle import eagle_row

        result["eagle"] = eagle_row(profile, eagle, result["notes"])
        print_eagle(result["eagle"])
    if args.branches_json:
        result["branches"] = _branches(args, profile, links)
    if args.batch:
        result["batch"] = _batch(args, profile, links, alpha)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0

"""`spd profile`: step times of model shapes on one device with random weights, as
`spd-profile/1` JSONs, then `spd plan` on them.

Per shape (default SmolLM2-135M, Llama-3.2-1B, Qwen3-4B and Llama-3.1-8B shapes, bf16 on
CUDA): every stage's one-token step at n = 2/4/8, the PDM step (K layers, n + 1 rows),
verification (final norm + LM head + argmax) and the AR step, eager and as CUDA graphs. On
CPU graphs are skipped (said in the output) and `--quick` uses tiny shapes, so the script is
testable anywhere. Plans use the links given: a netbench JSON (`--net`) and/or an assumed
link (`--assume-link`, labelled ASSUMED), and an acceptance alpha (labelled ASSUMED unless
it comes from an eval JSON).
"""
from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import asdict

DEFAULT_SHAPES = "smollm2-135m,llama-3.2-1b,qwen3-4b,llama-3.1-8b"
QUICK_CPU_SHAPES = "tiny-llama,tiny-qwen3"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    from spd_engine.tools.cli_conventions import add_dtype_argument

    add_dtype_argument(p, None, "weights and activations (default bfloat16 on cuda, float32 on cpu)")
    p.add_argument("--shapes", default=None,
                   help=f"presets (default {DEFAULT_SHAPES}; cpu --quick: {QUICK_CPU_SHAPES})")
    p.add_argument("--n", default="2,4,8", help="stage counts to time")
    p.add_argument("--context", type=int, default=None,
                   help="KV positions at the timed step (default 1024; --quick 128)")
    p.add_argument("--iters", type=int, default=None, help="timed steps per measurement (default 50; --quick 5)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 5; --quick 1)")
    p.add_argument("--pdm-layers", type=int, default=1, help="K of the PDM")
    p.add_argument("--no-graphs", action="store_true", help="time eager steps only")
    p.add_argument("--threads", type=int, default=1, help="torch threads on cpu")
    p.add_argument("--quick", action="store_true", help="few iterations, short context; tiny shapes on cpu")
    p.add_argument("--time-budget", type=float, default=270.0, help="seconds; later shapes are skipped past it")
    p.add_argument("--out-dir", default="runs/profile", help="where <shape>.json profiles and profile-run.json go")
    g = p.add_argument_group("plan on the profiles")
    g.add_argument("--net", help="netbench JSON (measured links)")
    g.add_argument("--assume-link", default="3,400,8",
                   help="LAT_US,GBPS[,ALLREDUCE_US], an ASSUMED link ('' for none; default NVLink-like 3,400,8)")
    g.add_argument("--alpha", type=float, default=0.8, help="acceptance for the plans (ASSUMED)")
    g.add_argument("--alpha-json", help="eval JSON with alpha_by_n (measured acceptance)")
    g.add_argument("--seed", type=int, default=0, help="seed of the random weights and of the plans' request sampling")


def _settings(args: argparse.Namespace):
    import torch

    from spd_engine.bench.profiling import DeviceSettings

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is available (use --device cpu --quick)")
    try:
        ns = tuple(int(x) for x in args.n.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"--n must be comma-separated integers, got {args.n!r}") from None
    if not ns or min(ns) < 1:
        raise ValueError("--n values must be >= 1")
    quick = args.quick
    context = args.context or (128 if quick else 1024)
    iters, warmup = args.iters or (5 if quick else 50), args.warmup if args.warmup is not None else (1 if quick else 5)
    if context < 16 or iters < 1 or warmup < 0 or args.pdm_layers < 1 or args.threads < 1:
        raise ValueError("need --context >= 16, --iters >= 1, --warmup >= 0, --pdm-layers >= 1, --threads >= 1")
    dtype = args.dtype or ("bfloat16" if device.startswith("cuda") else "float32")
    return DeviceSettings(device=device, dtype=dtype, ns=ns, context=context, iters=iters, warmup=warmup,
                          graphs=not args.no_graphs, pdm_layers=args.pdm_layers, seed=args.seed)


def _shapes(args: argparse.Namespace, device: str) -> list[str]:
    from spd_engine.engine.runtime.run_config import PRESETS
    from spd_engine.tools.cli_conventions import parse_names

    text = args.shapes or (QUICK_CPU_SHAPES if args.quick and device == "cpu" else DEFAULT_SHAPES)
    return parse_names(text, PRESETS, "shapes")


def _links(args: argparse.Namespace) -> list:
    """(label, Links) pairs: the measured netbench links and/or the assumed one."""
    from spd_engine.costmodel.cost_model import LinkModel, Links
    from spd_engine.tools.plan import assumed_link

    out = []
    if args.net:
        with open(args.net) as f:
            out.append(("measured links " + args.net, Links(LinkModel.from_netbench(json.load(f), args.net))))
    if args.assume_link:
        link = assumed_link(args.assume_link, "--assume-link")
        out.append((f"ASSUMED link ({link.name})", Links(link)))
    if not out:
        raise ValueError("give --net NETBENCH.json and/or --assume-link LAT_US,GBPS for the plans")
    return out


def _alpha(args: argparse.Namespace):
    from spd_engine.costmodel.cost_model import AlphaCurve

    if args.alpha_json:
        with open(args.alpha_json) as f:
            return AlphaCurve.from_eval_json(json.load(f)), f"alpha from {args.alpha_json}"
    if not 0 <= args.alpha <= 1:
        raise ValueError(f"--alpha must be in [0, 1], got {args.alpha}")
    return AlphaCurve({0: args.alpha}), f"ASSUMED alpha {args.alpha:g}"


def _device_name(device: str) -> str:
    import torch

    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device)).replace(" ", "-").lower()
    return "cpu"


def _summary_row(name: str, raw: dict) -> dict:
    best = lambda d: d["graphed"] if d["graphed"] is not None else d["eager"]  # noqa: E731
    row = {"shape": name, "ar_eager": raw["ar_ms"]["eager"], "ar_graph": raw["ar_ms"]["graphed"] or "-",
           "verify": best(raw["verify_ms"])}
    for n, v in raw["stage_ms"].items():
        row[f"stage{n}"] = max(v["graphed"] or v["eager"])
        row[f"stage{n}_eager"] = max(v["eager"])
    last = max(raw["pdm_ms"], default=None)
    row["pdm"] = f"{best(raw['pdm_ms'][last]):.3f} (n={last})" if last is not None else "-"
    return row


def _print_summary(rows: list[dict], ns: tuple[int, ...]) -> None:
    from spd_engine.bench.stats import format_table

    cols = [("shape", "shape", ""), ("ar_eager", "AR eager", ".3f"), ("ar_graph", "AR graph", ".3f"),
            ("verify", "verify", ".3f")]
    for n in ns:
        cols += [(f"stage{n}", f"max stage n={n}", ".3f"), (f"stage{n}_eager", "eager", ".3f")]
    cols.append(("pdm", "PDM, largest n", ""))
    print(format_table(rows, cols))


def run(args: argparse.Namespace) -> int:
    import torch

    from spd_engine.bench.profiling import fully_graphed, measure_shape, profile_json
    from spd_engine.costmodel.cost_model import Profile, plan, recommendation
    from spd_engine.engine.runtime.run_config import PRESETS
    from spd_engine.tools.plan import print_plan

    s = _settings(args)
    shapes, links, (alpha, alpha_label) = _shapes(args, s.device), _links(args), _alpha(args)
    dev_name = _device_name(s.device)
    if s.device == "cpu":  # one thread by default: on a shared host, more spin against other jobs
        torch.set_num_threads(args.threads)
    log = lambda m: print(m, flush=True)  # noqa: E731
    graphs_note = ("CUDA graphs: captured per step (eager fallback if a capture fails)" if s.graphs and
                   s.device.startswith("cuda") else
                   f"CUDA graphs: skipped ({'disabled' if not s.graphs else 'not on ' + s.device}); eager times only")
    log(f"# spd profile on {dev_name}, {s.dtype}, context {s.context}, {s.iters} iters, n = {list(s.ns)}, "
        f"PDM K={s.pdm_layers}, random weights\n# {graphs_note}")
    from spd_engine.bench.sync_time import host_sync_ms

    sync_ms = host_sync_ms(torch.device(s.device))
    log(f"# one host sync (one-element read after a tiny kernel): {1e3 * sync_ms:.1f} us")
    os.makedirs(args.out_dir, exist_ok=True)
    t_start, run_report, rows = time.perf_counter(), {"device": dev_name, "settings": asdict(s), "shapes": {}}, []
    for name in shapes:
        if time.perf_counter() - t_start > args.time_budget:
            log(f"# {name}: SKIPPED, past the time budget of {args.time_budget:g} s")
            run_report["shapes"][name] = {"skipped": "time budget"}
            continue
        log(f"## {name}")
        cfg = PRESETS[name]
        raw = measure_shape(cfg, s, log)
        profiles = {"eager": profile_json(name, cfg, raw, s, False, dev_name)}
        if fully_graphed(raw):
            profiles["graphs"] = profile_json(name, cfg, raw, s, True, dev_name)
        for prof in profiles.values():  # the cost model charges the runtime's host syncs with it
            prof["sync_ms"] = sync_ms
        files = {}
        for kind, prof in profiles.items():
            path = os.path.join(args.out_dir, f"{name}-{kind}.json")
            with open(path, "w") as f:
                json.dump(prof, f, indent=1)
            files[kind] = path
        main_kind = "graphs" if "graphs" in profiles else "eager"
        plans = {}
        for label, lk in links:
            result = plan(Profile.from_dict(profiles[main_kind]), lk, alpha, list(s.ns), 400, args.seed)
            result["recommendation"] = recommendation(result)
            plans[label] = result
            log(f"\n### plan: {profiles[main_kind]['name']}, {label}, {alpha_label}")
            print_plan(result, False)
        run_report["shapes"][name] = {"raw": raw, "profiles": files, "plans": plans}
        rows.append(_summary_row(name, raw))
        del raw
    log(f"\n# step times (ms, medians) on {dev_name}; 'max stage' is graphed where captured")
    _print_summary(rows, s.ns)
    log(f"# {graphs_note}; total {time.perf_counter() - t_start:.1f} s")
    with open(os.path.join(args.out_dir, "profile-run.json"), "w") as f:
        json.dump(run_report, f, indent=1, default=str)
    log(f"wrote {args.out_dir}/<shape>-{{eager,graphs}}.json and profile-run.json")
    return 0

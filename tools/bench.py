"""`spd bench`: ar, pp, spd (separate driver and co-located) and the serial eagle baseline in one run, same prompts and
machine; decode tok/s medians over repeats, speedups against both baselines (and the hf rows) with
their spread over repeats and a noisy mark, the eagle head's training budget beside its row, TTFT / TPOT /
inter-token latency percentiles, per-tick breakdown, JSON, a PNG timeline of a few spd ticks
and the spd tick timeline as a Chrome trace (Perfetto). `hf` and `hf-lookup` add transformers'
own greedy generate, plain and with prompt-lookup decoding, on the same prompts and threads. `--ignore-eos` runs every request to
--max-new-tokens, as vLLM's latency benchmark does. `--max-batch B,...` adds several requests in the
pipeline at once against one at a time (bench/batch_speed.py).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from spd_engine.bench.hf_peer import DEFAULT_LOOKUP_TOKENS, HFPeer
from spd_engine.bench.host_load import HostLoad, running
from spd_engine.bench.speed import BenchCase, bench
from spd_engine.bench.speedups import BASELINES, head_budget_note, noisy_lines, ratio_cell
from spd_engine.bench.stats import format_table
from spd_engine.engine.runtime.measured_split import BALANCED
from spd_engine.engine.runtime.run_config import RunConfig
from spd_engine.tools.cli_conventions import add_json_argument, refuse_ignored, write_json
from spd_engine.tools.engine_args import add_engine_arguments, engine_config
from spd_engine.tools.measured_args import balanced_split, record_layouts, split_key, split_store, with_measured_layouts
from spd_engine.tools.model_args import REPO_HEADS, hf_model_dir
from spd_engine.tools.prompt_args import load_prompts

CONFIGS = ("ar", "pp", "spd", "spd-w1", "spd-colocate", "spd-colocate-vd", "spd-colocate-1", "spd-overlap", "eagle", "hf",
           "hf-lookup",
           "hf-assisted", "tp", "spd-tp")

COLUMNS = [("name", "config", ""), ("world_size", "ranks", ""), ("decode_tok_s", "tok/s", ".2f"),
           ("decode_tok_s_min", "min", ".2f"), ("decode_tok_s_max", "max", ".2f"),
           ("x_ar", "x ar", ""), ("x_pp", "x pp", ""), ("tick_ms", "ms/tick", ".2f"),
           ("prefill_s", "prefill s", ".2f"), ("tokens", "tokens", ""), ("ticks", "ticks", ""),
           ("alpha", "alpha", ".3f"), ("eal", "EAL", ".2f"), ("acceptance_length", "acc len", ".2f"),
           ("equal_prompts", "= ar", ""),
           ("lossless", "lossless", "")]
RATIO_LEGEND = ("x <row>: median over repeats of this row's tok/s over that row's in the same repeat, (min-max) of "
                "those ratios; noisy: a single repeat, or a spread (max - min) wider than the gain |x - 1|")
LATENCY_COLUMNS = [("name", "config", "")] + [
    (f"{m}_p{q}_ms", f"{label} p{q}", ".2f") for m, label in (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"))
    for q in (50, 90, 99)]


def add_arguments(p: argparse.ArgumentParser) -> None:
    from spd_engine.tools.prompt_args import add_request_arguments

    add_engine_arguments(p, mode_flags=False)  # --configs names the modes and layouts
    g = p.add_argument_group("benchmark")
    add_request_arguments(g)
    g.add_argument("--ignore-eos", action="store_true", help="generate --max-new-tokens for every request, past EOS")
    g.add_argument("--repeats", type=int, default=3, help="timed runs of every prompt per configuration")
    g.add_argument("--configs", default="ar,pp,spd,spd-colocate",
                   help=f"subset of {','.join(CONFIGS)} (tp: one stage over --tp ranks; spd-tp: SPD with --tp "
                        "ranks per stage, the other rows run without TP; hf, hf-lookup: transformers' generate, "
                        "needs an HF model)")
    g.add_argument("--assistant", metavar="MODEL", default=None,
                   help="hf-assisted: the draft model of transformers' assisted generation (same tokenizer; "
                        "a model spec as --model, e.g. qwen2.5-coder-0.5b beside --model qwen2.5-coder-1.5b)")
    g.add_argument("--lookup-tokens", type=int, default=DEFAULT_LOOKUP_TOKENS,
                   help="hf-lookup: prompt_lookup_num_tokens (tokens drafted per lookup)")
    g.add_argument("--synthetic-alpha", type=float, default=None,
                   help="replace drafts: reference token with this probability (labelled synthetic)")
    g.add_argument("--host-load", metavar="BUSY/IDLE[xN]", default=None,
                   help="run every row under the same competing load: N processes (default 1) that each spin "
                        "BUSY ms and sleep IDLE ms in turn, e.g. 2/6 (bench/host_load.py); no split is recorded")
    g.add_argument("--max-batch", metavar="B[,B...]", default=None,
                   help="also run every prompt as one request, all submitted together, up to B at once in the "
                        "spd-colocate (else spd) pipeline, against the same requests one at a time: tok/s, TPOT, "
                        "TTFT, stage utilization per B (bench/batch_speed.py)")
    add_json_argument(g, "the full report")
    g.add_argument("--plot", metavar="SVG", default=None,
                   help="draw every row's tok/s over ar's with its min-max over repeats as SVG (bench/results_plot.py; "
                        "with --synthetic-alpha 1.0 the SPD row is drawn as the ceiling; spd plan --results-figure "
                        "joins saved runs and acceptance)")
    g.add_argument("--timeline", metavar="PNG", help="PNG timeline of a few spd ticks")
    g.add_argument("--chrome-trace", metavar="JSON", help="the first spd request's tick timeline as a Chrome "
                                                         "trace (open in ui.perfetto.dev or chrome://tracing)")
    g.add_argument("--profile-out", help="write an spd-profile/1 JSON (spd plan's input) from this run: "
                                          "needs ar and spd or spd-colocate (their ticks are traced)")


def config_names(args: argparse.Namespace) -> list[str]:
    return [c.strip() for c in args.configs.split(",") if c.strip()]


def cases(args: argparse.Namespace, ecfg) -> list[BenchCase]:
    names = config_names(args)
    bad = set(names) - set(CONFIGS)
    if bad:
        raise ValueError(f"unknown bench configs {sorted(bad)}")
    T = ecfg.parallel.topology.tp
    if T == 1 and {"tp", "spd-tp"} & set(names):
        raise ValueError("the tp and spd-tp configs need --tp >= 2")
    topo = dataclasses.replace(ecfg.parallel.topology, tp=1)
    ecfg = ecfg.replace(topology=topo)  # --tp is for the tp rows only
    one = dataclasses.replace(topo, stage_layers=(topo.num_layers,), colocate=False)
    out = [BenchCase("ar", ecfg.replace(mode="ar", topology=one))]
    profiling = bool(getattr(args, "profile_out", None))
    if "pp" in names:
        out.append(BenchCase("pp", ecfg.replace(mode="pp", trace=profiling)))
    if profiling and not {"spd", "spd-colocate"} & set(names):
        raise ValueError("--profile-out needs an spd or spd-colocate run in --configs")
    if "spd" in names:
        out.append(BenchCase("spd", ecfg.replace(mode="spd", topology=dataclasses.replace(topo, colocate=False),
                                                 trace=bool(args.timeline or args.chrome_trace) or profiling)))
    if "spd-w1" in names:  # the same SPD run without branch points: what W costs and buys
        out.append(BenchCase("spd-w1", ecfg.replace(mode="spd", branches=1,
                                                    topology=dataclasses.replace(topo, colocate=False))))
    if "spd-colocate" in names:  # always traced: its per-tick residual (bench/speed.py)
        colo = ecfg.replace(mode="spd", overlap_stage0=False, topology=dataclasses.replace(topo, colocate=True),
                            trace=True)
        if getattr(args, "stage_layers", None) == BALANCED:  # the co-located driver's costs have a record of their own
            colo, why = balanced_split(colo, colocate=True)
            print(f"spd-colocate, --stage-layers balanced: {why}", file=sys.stderr)
        out.append(BenchCase("spd-colocate", colo))
    if "spd-colocate-vd" in names:  # the same, verifying on the driver (--verify-at driver): what moving it buys
        out.append(BenchCase("spd-colocate-vd", ecfg.replace(mode="spd", overlap_stage0=False, verify_at="driver",
                                                             topology=dataclasses.replace(topo, colocate=True),
                                                             trace=True)))
    if "spd-colocate-1" in names:  # the same, one token per entry (--suffix-run 1): what suffix runs buy
        out.append(BenchCase("spd-colocate-1", ecfg.replace(mode="spd", overlap_stage0=False, suffix_run=1,
                                                            topology=dataclasses.replace(topo, colocate=True))))
    if "spd-overlap" in names:  # co-located, stage 0 on its own thread (engine/runtime/stage0_overlap.py)
        out.append(BenchCase("spd-overlap", ecfg.replace(mode="spd", overlap_stage0=True,
                                                         topology=dataclasses.replace(topo, colocate=True))))
    if "eagle" in names:  # the serial baseline on one rank (engine/runtime/eagle_driver.py)
        out.append(BenchCase("eagle", ecfg.replace(mode="eagle", topology=one)))
    if args.assistant is not None and "hf-assisted" not in names:
        raise ValueError("--assistant: not used without the hf-assisted config")
    for name in ("hf", "hf-lookup", "hf-assisted"):
        if name in names:
            lookup = args.lookup_tokens if name == "hf-lookup" else None
            if name == "hf-assisted" and args.assistant is None:
                raise ValueError("the hf-assisted config needs --assistant MODEL (its draft model)")
            assistant = hf_model_dir(args.assistant) if name == "hf-assisted" else None
            peer = HFPeer(hf_model_dir(args.model), ecfg.model.torch_dtype, out[0].ecfg.threads_per_rank(), lookup,
                          assistant)
            out.append(BenchCase(name, out[0].ecfg, peer))
    if {"tp", "spd-tp"} & set(names):  # tp runs first of the TP rows: it is their lossless reference
        out.append(BenchCase("tp", ecfg.replace(mode="tp", topology=dataclasses.replace(one, colocate=True, tp=T))))
    if "spd-tp" in names:
        out.append(BenchCase("spd-tp", ecfg.replace(mode="spd", topology=dataclasses.replace(topo, colocate=False,
                                                                                               tp=T))))
    return out


def table(rows: list[dict]) -> tuple[list[dict], list[tuple[str, str, str]]]:
    """The main table's rows and columns: every ratio as one cell with its spread and noisy mark
    (bench/speedups.py), columns against hf rows when the run has them, a note column when a row has a note."""
    shown = [{**r, **{f"x_{key}": ratio_cell(r, key) for _, key in BASELINES}} for r in rows]
    names = {r["name"] for r in rows}
    columns = list(COLUMNS)
    at = columns.index(("x_pp", "x pp", "")) + 1
    columns[at:at] = [(f"x_{key}", f"x {base}", "") for base, key in BASELINES
                      if base.startswith("hf") and base in names]
    if any(r.get("note") for r in rows):
        columns.append(("note", "note", ""))
    return shown, columns


def eagle_budget(rows: list[dict], ecfg, model: str) -> str | None:
    """Put on the eagle row how its head was trained against the PDM heads it is read beside (this
    run's and the model's shipped ones, bench/speedups.py); the full sentence for under the table."""
    row = next((r for r in rows if r["name"] == "eagle"), None)
    if row is None:
        return None
    shipped = [] if set("/:\\") & set(model) else sorted(REPO_HEADS.glob(f"{model}-n*"))  # built-in names only
    pdm_heads = {f"{d.name} PDM head": str(d) for d in shipped if (d / "pdm.json").is_file()}
    if ecfg.drafting.pdm != "random" and any(r["mode"] == "spd" for r in rows) and ecfg.drafting.pdm not in pdm_heads.values():
        pdm_heads[f"this run's PDM head {ecfg.drafting.pdm}"] = ecfg.drafting.pdm
    budget = head_budget_note(ecfg.drafting.eagle_head, pdm_heads)
    row["head_budget"], row["note"] = budget, budget["note"]
    if budget["under_trained"] and budget["head_training_source"] is not None:
        return (f"eagle: its head is under-trained, {budget['head_training_tokens'] / 1e6:.2f} M training tokens "
                f"({budget['head_training_source']}) against {budget['reference_tokens'] / 1e6:.2f} M for the "
                f"{budget['reference']}: its row is not a like-for-like baseline of the method")
    return f"eagle: {budget['note']}"


def write_profile(report: dict, ecfg, path: str, load: HostLoad | None) -> None:
    """The run's spd-profile/1 (bench/profiling.py), with the host's cores and load recorded."""
    import os

    from spd_engine.bench.profiling import profile_from_bench

    host = f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} after the run"
    if load is not None:
        host += f", under {load.describe()}"
    prof = profile_from_bench(report, ecfg, os.cpu_count(), host)
    with open(path, "w") as f:
        json.dump(prof, f, indent=1)
    print(f"profile ({prof['source']['spd_row']} run): {path}")


def max_batches(args: argparse.Namespace) -> list[int]:
    """--max-batch as B values, checked before any work."""
    if args.max_batch is None:
        return []
    try:
        batches = [int(b) for b in args.max_batch.split(",") if b.strip()]
    except ValueError:
        raise ValueError(f"--max-batch takes comma-separated integers, got {args.max_batch!r}") from None
    if not batches or min(batches) < 1:
        raise ValueError(f"--max-batch values must be >= 1, got {args.max_batch!r}")
    if not {"spd", "spd-colocate"} & set(config_names(args)):
        raise ValueError("--max-batch needs spd or spd-colocate in --configs (the pipeline it fills)")
    if args.synthetic_alpha is not None:
        raise ValueError("--max-batch runs the head's own drafts: not with --synthetic-alpha")
    return batches


def batch_rows(args: argparse.Namespace, bench_cases: list[BenchCase], prompts, eos, batches: list[int],
               progress) -> list[dict]:
    """The several-requests table's rows, on the spd-colocate case's config (else spd's)."""
    from spd_engine.bench.batch_speed import measure_batches, summary
    from spd_engine.engine.runtime.batch_driver import BatchRequest
    from spd_engine.engine.runtime.launch import launch

    case = next(c for name in ("spd-colocate", "spd") for c in bench_cases if c.name == name)
    reqs = [BatchRequest(list(ids), args.max_new_tokens, eos) for ids in prompts]
    with launch(case.ecfg.replace(trace=False)) as runtime:
        rows = summary(measure_batches(runtime, reqs, batches, args.repeats, progress))
    for r in rows:
        r["pipeline"] = case.name
    return rows


def measure_layouts(ecfg: RunConfig, out) -> RunConfig:
    """Time and record the weight layouts for each rank thread count of the bench's rows (ar: every
    core; pipelines: a share) and return `ecfg` taking them under `--weight-layout auto`."""
    topo = ecfg.parallel.topology
    ranks = (1, topo.n * topo.tp, topo.n * topo.tp + 1)
    counts = {ecfg.parallel.threads} if ecfg.parallel.threads else {ecfg.threads_per_rank(w) for w in ranks}
    record_layouts(ecfg.model.source, ecfg.model.cfg, ecfg.parallel.device, sorted(counts), out)
    return with_measured_layouts(ecfg)


def record_splits(rows: list[dict], bench_cases: list[BenchCase], out) -> None:
    """Keep each SPD row's split advice for `--stage-layers balanced` (engine/runtime/measured_split.py)."""
    store = split_store()
    for row in (r for r in rows if r.get("split") and r["name"] in ("spd", "spd-colocate")):  # the default drivers
        case = next(c for c in bench_cases if c.name == row["name"])
        if case.ecfg.drafting.branches not in (None, 1):  # a branching run's costs are not the default run's
            continue
        store.record(split_key(case.ecfg), row["split"], case.ecfg.drafting.pdm)
        print(f"{row['name']}: its balanced split {row['split']['balanced_layers']} recorded for "
              f"--stage-layers balanced ({store.path})", file=out)


def split_line(name: str, split: dict) -> str:
    """One SPD row's split against the one that balances its measured per-tick costs."""
    now = f"{name} split {split['stage_layers']}: busiest rank {split['busiest_ms']:.2f} ms per tick from its parts"
    if split["balanced_layers"] == split["stage_layers"]:
        return now + " (balanced for these costs: no other split has a less busy rank)"
    layers = ",".join(map(str, split["balanced_layers"]))
    return (now + f"; the split balancing them: {split['balanced_layers']}, predicted {split['balanced_busiest_ms']:.2f} "
            f"ms (--stage-layers {layers})")


def check_plot(args: argparse.Namespace) -> None:
    """--plot refused before the run when it could not be drawn or written after it."""
    if args.plot is None:
        return
    from spd_engine.tools.cli_conventions import check_output_path

    check_output_path(args.plot, "--plot")
    if args.synthetic_alpha not in (None, 1.0):
        raise ValueError("--plot draws real acceptance, or the ceiling with --synthetic-alpha 1.0; "
                         f"not --synthetic-alpha {args.synthetic_alpha}")
    if args.synthetic_alpha == 1.0 and not any(c.startswith("spd") for c in config_names(args)):
        raise ValueError("--plot with --synthetic-alpha 1.0 draws the SPD row as the ceiling: --configs has none")


def run(args: argparse.Namespace) -> int:
    from spd_engine.engine.model.tokenizer import Tokenizer
    from spd_engine.engine.runtime.request_inputs import encode_prompts

    if args.synthetic_alpha is not None and not 0 <= args.synthetic_alpha <= 1:
        raise ValueError(f"--synthetic-alpha must be in [0, 1], got {args.synthetic_alpha}")
    if args.repeats < 1:
        raise ValueError("--repeats must be >= 1")
    check_plot(args)
    load = HostLoad.parse(args.host_load) if args.host_load is not None else None
    refuse_ignored(args, ["overlap_stage0"], "by spd bench: its spd-overlap config is the overlapped driver")
    ecfg, tok_dir = engine_config(args, seed_used=args.synthetic_alpha is not None,  # it seeds the policy
                                  eagle_used="eagle" in config_names(args))
    tok = Tokenizer.from_dir(tok_dir) if tok_dir is not None else None
    prompts = encode_prompts(load_prompts(args), tok, args.chat, ecfg.model.cfg.vocab_size)
    eos = () if args.ignore_eos else tok.eos_ids if tok is not None else ecfg.model.cfg.eos_token_ids
    progress = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    batches = max_batches(args)
    if ecfg.model.weight_layout == "auto" and ecfg.parallel.device.startswith("cpu") and load is None:  # the device's own costs
        ecfg = measure_layouts(ecfg, sys.stderr)
    bench_cases = cases(args, ecfg)
    with running(load):
        report = bench(bench_cases, prompts, args.max_new_tokens, eos, args.repeats, args.synthetic_alpha,
                       args.seed, progress)
        if batches:
            report["batches"] = batch_rows(args, bench_cases, prompts, eos, batches, progress)
    report["host_load"] = load.to_dict() if load is not None else None
    report["model"], report["head"] = ecfg.model.source, ecfg.drafting.pdm
    report["link_delay_us"] = ecfg.parallel.link_delay_us  # an emulated link latency, when one was asked for
    eagle_line = None
    if "eagle" in config_names(args):
        report["eagle_head"], report["eagle_k"] = ecfg.drafting.eagle_head, ecfg.drafting.eagle_k
        if args.synthetic_alpha is None:  # synthetic drafts replace the head's: its training does not show
            eagle_line = eagle_budget(report["rows"], ecfg, args.model)
    label = f" (SYNTHETIC acceptance alpha={args.synthetic_alpha})" if args.synthetic_alpha is not None else ""
    out = sys.stderr if args.json == "-" else sys.stdout  # stdout carries only the JSON then
    print(f"model {ecfg.model.source}, head {ecfg.drafting.pdm}, n={ecfg.parallel.topology.n}, {len(prompts)} prompts x "
          f"{args.max_new_tokens} tokens{' (EOS ignored)' if args.ignore_eos else ''}, {args.repeats} repeats{label}"
          f"{f', every row under {load.describe()}' if load is not None else ''}"
          f"{f', EMULATED LINK LATENCY {ecfg.parallel.link_delay_us:g} us per message' if ecfg.parallel.link_delay_us else ''}",
          file=out)
    print(format_table(*table(report["rows"])), file=out)
    for line in [RATIO_LEGEND, *noisy_lines(report["rows"])] + ([eagle_line] if eagle_line else []):
        print(line, file=out)
    print("latency (ms; TTFT per request, TPOT per request, ITL per token gap; numpy percentiles):", file=out)
    print(format_table(report["rows"], LATENCY_COLUMNS), file=out)
    spd = next((r for r in report["rows"] if r["name"] == "spd"), None)
    if spd:
        print("spd per-tick breakdown (ms, medians): " +
              ", ".join(f"{k}={v:.2f}" for k, v in spd["breakdown_ms_per_tick"].items()), file=out)
    for colo in (r for r in report["rows"] if r.get("residual_ms") is not None):
        print(f"{colo['name']} residual (tick - busiest rank's compute: stage 0 + PDM + driver verify, or a later "
              f"stage's): mean {colo['residual_ms']:.3f} ms, per tick p50 {colo['residual_tick_p50_ms']:.3f} / "
              f"p90 {colo['residual_tick_p90_ms']:.3f} ms (last repeat, {colo['residual_ticks']} ticks)", file=out)
    for row in (r for r in report["rows"] if r.get("split")):
        print(split_line(row["name"], row["split"]), file=out)
    # costs measured under a made-up load or an emulated link are not the device's
    if args.synthetic_alpha is None and load is None and not ecfg.parallel.link_delay_us:
        record_splits(report["rows"], bench_cases, out)
    if args.timeline and "spd" in report["traces"]:
        from spd_engine.bench.timeline import plot_timeline

        if plot_timeline(report["traces"]["spd"], args.timeline, f"spd n={ecfg.parallel.topology.n}{label}"):
            print(f"timeline: {args.timeline}", file=out)
    if args.chrome_trace:
        if "spd" not in report["traces"]:
            raise ValueError("--chrome-trace needs spd in --configs")
        from spd_engine.bench.chrome_trace import write_chrome_trace

        write_chrome_trace(report["traces"]["spd"], args.chrome_trace, f"spd n={ecfg.parallel.topology.n}{label}")
        print(f"chrome trace: {args.chrome_trace}", file=out)
    if batches:
        from spd_engine.bench.batch_speed import format_summary

        print(f"several requests in the {report['batches'][0]['pipeline']} pipeline: the {len(prompts)} prompts "
              f"submitted together, up to B at once, against one at a time (medians over {args.repeats} repeats):",
              file=out)
        print("\n".join(format_summary(report["batches"])), file=out)
    if args.json:
        write_json(args.json, report)
    if args.plot:
        from spd_engine.bench.results_plot import figure_data, results_svg, write_svg

        write_svg(args.plot, results_svg(figure_data([("this run", report)])))
        print(f"plot: {args.plot}", file=out)
    if args.profile_out:
        write_profile(report, ecfg, args.profile_out, load)
    if report["peer_mismatches"]:
        print(f"note: transformers' tokens differ from the engine's greedy tokens for {report['peer_mismatches']} "
              f"(other kernels, other rounding: see equal_prompts)", file=out)
    unequal = [r["config"] for r in report.get("batches", []) if r["equal"] != r["requests"]]
    if unequal:
        print(f"LOSSLESS CHECK FAILED: several requests at once gave other tokens than one at a time at {unequal}",
              file=sys.stderr)
    if report["mismatches"]:
        print(f"LOSSLESS CHECK FAILED for {report['mismatches']}", file=sys.stderr)
    if unequal or report["mismatches"]:
        return 1
    return 0

"""`spd eval`: acceptance (alpha, EAL) of a PDM head on prompt sets, per dataset and overall; with
`--mode eagle`, the eagle baseline's alpha and acceptance length (train/eagle_eval.py).

Prompts: `<data-dir>/{mt_bench,humaneval,gsm8k}.jsonl` (EAGLE format, first turn, chat template
applied). `--executor fast` (default at T=0) computes the exact T=0 counts from one greedy decode
and one teacher-forced pass per prompt; `reference` and `dist` run the SPD runtime and at T=0
check every output against greedy decoding (exit code 1 on any mismatch). At T>0 (`--temperature`,
`--top-k`, `--top-p`, `--sampling-seed`) the runtime samples (`reference` by default) and the
seed of every request is recorded instead. Progress goes to stderr.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from spd_engine.engine.runtime.run_config import Mode
from spd_engine.train.evaluate import DATASETS, EXECUTORS, EvalSettings, check_settings, default_data_dir, default_executor


def add_arguments(p: argparse.ArgumentParser) -> None:
    from spd_engine.tools.cli_conventions import add_json_argument
    from spd_engine.tools.engine_args import add_engine_arguments

    add_engine_arguments(p, mode_flags=False)  # acceptance does not depend on the layout
    g = p.add_argument_group("evaluation")
    g.add_argument("--mode", choices=("spd", "eagle"), default="spd",
                   help="spd: the PDM head's alpha and EAL; eagle: the eagle baseline's alpha and acceptance length")
    g.add_argument("--data-dir", default=None,
                   help=f"directory with {', '.join(d + '.jsonl' for d in DATASETS)} "
                        f"(default: the prompt sets shipped in the package, train/evalsets)")
    g.add_argument("--datasets", default=",".join(DATASETS), help="comma-separated subset of the prompt sets")
    g.add_argument("--limit", type=int, default=None, help="prompts per dataset (default: all)")
    g.add_argument("--max-new-tokens", type=int, default=256, help="tokens to generate per prompt at most")
    g.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default); > 0: sampling")
    g.add_argument("--top-k", type=int, default=0, help="sampling: keep the k most likely tokens (0 = off)")
    g.add_argument("--top-p", type=float, default=1.0, help="sampling: nucleus mass in (0, 1] (1 = off)")
    g.add_argument("--sampling-seed", type=int, default=0,
                   help="sampling: request k of the run draws with seed + k (--seed seeds untrained heads)")
    g.add_argument("--executor", choices=EXECUTORS, default=None,
                   help="fast (default at T=0): exact teacher-forced replay, T=0 only; reference (default "
                        "at T>0): the runtime in one process; dist: one process per rank")
    add_json_argument(g, "summaries and per-prompt records")
    g.add_argument("--plot", default=None, metavar="PNG|SVG",
                   help="also draw alpha by fill and by dataset and the drafts by source to this PNG (matplotlib); "
                        "a name ending in .svg: the results figure's acceptance panel, this run's EAL at its n "
                        "(bench/results_plot.py, no matplotlib; spd plan --results-figure joins several runs)")
    g.add_argument("--reference-cache", default=None, metavar="DIR",
                   help="fast executor: keep greedy reference outputs here and reuse them (several heads, one target)")


def _data_dir(arg: str | None) -> Path:
    if arg is not None:
        d = Path(arg)
        if not d.is_dir():
            raise ValueError(f"--data-dir {d} is not a directory")
        return d
    d = default_data_dir()
    if d is None:
        raise ValueError("no --data-dir given and this installation has no shipped prompt sets (train/evalsets)")
    return d


def _datasets(arg: str) -> list[str]:
    from spd_engine.tools.cli_conventions import parse_names

    return parse_names(arg, DATASETS, "dataset(s)")


def run(args: argparse.Namespace) -> int:
    import torch

    from spd_engine.engine.model.tokenizer import Tokenizer
    from spd_engine.engine.runtime.progress import Progress
    from spd_engine.tools.cli_conventions import write_json
    from spd_engine.tools.engine_args import engine_config
    from spd_engine.train.evaluate import encode_prompt, evaluate, format_table, load_dataset, open_runner

    if args.mode == Mode.EAGLE:
        from spd_engine.tools.cli_conventions import refuse_ignored

        refuse_ignored(args, ["executor"], "with --mode eagle (its runtime runs in this process)")
    executor = "reference" if args.mode == Mode.EAGLE else args.executor or default_executor(args.temperature)
    settings = EvalSettings(args.max_new_tokens, args.temperature, executor, args.limit, args.top_k, args.top_p,
                            args.sampling_seed)
    check_settings(settings)  # before any model is loaded
    if args.plot:  # a missing matplotlib or an unwritable path is refused before the run, not after it
        from spd_engine.tools.cli_conventions import check_output_path

        check_output_path(args.plot, "--plot")
        if not args.plot.endswith(".svg"):
            import matplotlib  # noqa: F401
        elif args.mode == Mode.EAGLE:
            raise ValueError("--plot *.svg draws SPD's EAL by n; not with --mode eagle (its PNG does)")
    data_dir, names = _data_dir(args.data_dir), _datasets(args.datasets)
    prompts = [p for name in names for p in load_dataset(data_dir, name, args.limit)]
    ecfg, tok_dir = engine_config(args)
    tok = Tokenizer.from_dir(tok_dir) if tok_dir is not None else None
    eos = tok.eos_ids if tok is not None else ecfg.model.cfg.eos_token_ids
    encoded = [(p, encode_prompt(p.text, tok, ecfg.model.cfg.vocab_size)) for p in prompts]
    for p, ids in encoded:
        if len(ids) + settings.max_new_tokens > ecfg.runtime.capacity:
            raise ValueError(f"{p.dataset}#{p.index}: prompt ({len(ids)} tokens) + --max-new-tokens "
                             f"{settings.max_new_tokens} exceeds --capacity {ecfg.runtime.capacity}")
    if args.threads and args.executor != "dist":  # dist ranks set their own threads
        torch.set_num_threads(args.threads)
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    n = ecfg.parallel.topology.n
    draft = ecfg.drafting
    head = f"eagle head {draft.eagle_head}, k={draft.eagle_k}" if ecfg.mode is Mode.EAGLE else f"head {draft.pdm}"
    log(f"spd eval: {len(encoded)} prompts from {data_dir}, n={n} {list(ecfg.parallel.topology.stage_layers)}, "
        f"{head}, executor {executor}")
    t0 = time.perf_counter()
    with open_runner(ecfg, settings, args.reference_cache) as runner, \
            Progress(len(encoded), "spd eval", log, unit="prompt") as bar:
        report = evaluate(runner, encoded, n, settings, eos, progress=log, bar=bar)
    wall = time.perf_counter() - t0
    if ecfg.mode is Mode.EAGLE:
        from spd_engine.train.eagle_eval import format_eagle_table

        print(format_eagle_table(report))
    else:
        print(format_table(report))
    footer = f"n={n}, {settings.max_new_tokens} max new tokens, executor {executor}, {wall:.1f}s"
    if settings.temperature > 0:  # samples: reproducible from the seeds, not comparable token by token
        footer += (f", sampling T={settings.temperature} top-k {settings.top_k} top-p {settings.top_p} "
                   f"seeds {settings.seed}+k (not checked against greedy)")
    if ecfg.mode is Mode.EAGLE:
        footer = f"eagle k={ecfg.drafting.eagle_k}, " + footer
    if ecfg.max_run > 1:
        footer += f", suffix runs of up to {ecfg.max_run} tokens"
        slots = getattr(runner, "stage_slots", 0)  # the fast executor counts what a stage step carries
        if slots:
            footer += f" ({runner.stage_tokens / slots:.2f} tokens per stage step)"
    if executor == "fast":  # where the runtime's other shapes could flip a draft's argmax
        total = report.summary()
        footer += (f", {total.near_ties} consulted drafts within 1e-4 of a tie, {total.outside_vocab} of "
                   f"{total.verified} verified tokens outside the draft vocabulary")
    print(footer)
    eagle, draft = ecfg.mode is Mode.EAGLE, ecfg.drafting
    meta = {"model": args.model, "mode": ecfg.mode, "spec": draft.eagle_head if eagle else draft.pdm,
            "eagle_k": draft.eagle_k if eagle else None, "n": n,
            "stage_layers": list(ecfg.parallel.topology.stage_layers), "executor": executor,
            "max_new_tokens": settings.max_new_tokens, "temperature": settings.temperature,
            "top_k": settings.top_k, "top_p": settings.top_p, "seed": settings.seed, "data_dir": str(data_dir), "wall_s": wall,
            "suffix_run": ecfg.max_run, "suffix_drafts": ecfg.drafting.suffix_drafts}
    if args.json:
        write_json(args.json, report.to_json(meta))
    if args.plot and args.plot.endswith(".svg"):
        from spd_engine.bench.results_plot import figure_data, results_svg, write_svg

        write_svg(args.plot, results_svg(figure_data([("this run", report.to_json(meta))])))
        print(f"spd eval: plot written to {args.plot}", file=sys.stderr)
    elif args.plot:
        from spd_engine.bench.plot import plot_eval

        plot_eval(report.to_json(meta), args.plot)
        print(f"spd eval: plot written to {args.plot}", file=sys.stderr)
    for r in report.failures:
        print(f"FAIL: {r.dataset}#{r.index}: {ecfg.mode} output differs from greedy decoding", file=sys.stderr)
    return 1 if report.failures else 0

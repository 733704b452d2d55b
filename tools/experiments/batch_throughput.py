"""Several requests in the pipeline (docs/design.md 3.12): throughput, per-request latency and
stage utilization against B, in one launch of the ranks.

    spd measure batch-throughput --requests 8 --batches 1,2,4 --repeats 3 -- \\
        --model smollm2-135m --stages 2 --colocate --prompts-file train/evalsets/mt_bench.jsonl \\
        --chat --max-new-tokens 64

Arguments after `--` are `spd generate`'s (model, topology, head, prompts). The first `--requests`
prompts are all submitted at tick 1; each repeat runs them once one at a time with the single-request
path (`generate`, as `spd generate` without --max-batch) and once per B with `generate_batch`, the
configurations in a rotated order per repeat so drift over the run touches each alike. Reported per
configuration: aggregate tokens/s (median, min-max over repeats) and its ratio to the one-at-a-time
row, the median time per output token and time to first token over the requests, the stage
utilization and rows per busy stage step of the last repeat, and how many requests gave the same
tokens as the one-at-a-time run; then, per configuration, the time of a tick, each stage's compute
per step and the driver's PDM time per tick (the one-at-a-time row: its requests' ticks).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time



def _args(argv: list[str]) -> tuple[argparse.Namespace, argparse.Namespace]:
    from spd_engine.tools import generate

    p = argparse.ArgumentParser(prog="spd measure batch-throughput", description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=8, help="requests submitted together (default 8)")
    p.add_argument("--batches", default="1,2,4", help="comma-separated B values (default 1,2,4)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs of every configuration (default 3)")
    if "--" in argv:
        i = argv.index("--")
        own, rest = argv[:i], argv[i + 1:]
    else:
        own, rest = argv, []
    args = p.parse_args(own)
    g = argparse.ArgumentParser(prog="spd measure batch-throughput ... --")
    generate.add_arguments(g)
    gen = g.parse_args(rest)
    batches = [int(b) for b in args.batches.split(",") if b.strip()]
    if args.requests < 1 or args.repeats < 1 or not batches or min(batches) < 1:
        raise ValueError("--requests, --repeats and every --batches value must be >= 1")
    args.batch_list = batches
    return args, gen


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
    return dict(tokens_s=tokens / wall, tpot_ms=1e3 * statistics.median(tpot),
                ttft_s=statistics.median(t - t0 for t in ttft),
                tokens=[r.tokens for r in results], utilization=None, rows_per_step=1.0,
                tick_ms=1e3 * sum(r.decode_s for r in results) / ticks, stage_ms=stage_ms,
                pdm_ms=1e3 * sum(r.driver["pdm"] for r in results) / ticks)


def _batched(runtime, reqs, B: int) -> dict:
    out = runtime.generate_batch(reqs, B)
    u = out.utilization
    tpot = [t for t, r in zip(out.tpot_s, out.results) if r.decode_tokens]
    return dict(tokens_s=out.tokens_per_s, tpot_ms=1e3 * statistics.median(tpot), ttft_s=statistics.median(out.ttft_s),
                tokens=[r.tokens for r in out.results], utilization=u,
                rows_per_step=sum(u.rows) / max(1, sum(u.steps)), tick_ms=1e3 * out.wall_s / out.ticks,
                stage_ms=[1e3 * st["compute_s"] / max(1.0, st["messages"]) for st in out.stages],
                pdm_ms=1e3 * sum(r.driver["pdm"] for r in out.results) / out.ticks)


def main(argv: list[str] | None = None) -> int:
    from spd_engine.engine.model.tokenizer import Tokenizer
    from spd_engine.engine.protocol.batch_schedule import format_utilization
    from spd_engine.engine.runtime.batch_driver import BatchRequest
    from spd_engine.engine.runtime.launch import launch
    from spd_engine.engine.runtime.request_inputs import encode_prompts
    from spd_engine.tools.common import engine_config, load_prompts

    args, gen = _args(sys.argv[1:] if argv is None else argv)
    ecfg, tok_dir = engine_config(gen)
    if ecfg.mode != "spd":
        raise ValueError(f"batch-throughput measures SPD (--mode spd), got --mode {ecfg.mode}")
    tok = Tokenizer.from_dir(tok_dir) if tok_dir is not None else None
    texts = load_prompts(gen)
    texts = [texts[i % len(texts)] for i in range(args.requests)]
    prompts = encode_prompts(texts, tok, gen.chat, ecfg.cfg.vocab_size)
    eos = () if gen.ignore_eos else (tok.eos_ids if tok is not None else ecfg.cfg.eos_token_ids)
    reqs = [BatchRequest(ids, gen.max_new_tokens, eos) for ids in prompts]
    configs = ["one at a time"] + [f"B={b}" for b in args.batch_list]
    runs: dict[str, list[dict]] = {c: [] for c in configs}
    with launch(ecfg) as runtime:
        _batched(runtime, reqs[:2], 2)  # warm-up: first-use allocations of the slots' caches
        for rep in range(args.repeats):
            order = configs[rep % len(configs):] + configs[:rep % len(configs)]
            for c in order:
                runs[c].append(_one_at_a_time(runtime, reqs) if c == "one at a time" else
                               _batched(runtime, reqs, int(c[2:])))
                print(f"repeat {rep + 1}/{args.repeats} {c}: {runs[c][-1]['tokens_s']:.2f} tok/s",
                      file=sys.stderr, flush=True)
    want = runs["one at a time"][0]["tokens"]
    base = statistics.median(r["tokens_s"] for r in runs["one at a time"])
    print(f"model {ecfg.model}, head {ecfg.pdm}, n={ecfg.topology.n}, colocate={ecfg.topology.colocate}, "
          f"{args.requests} requests x {gen.max_new_tokens} tokens, {args.repeats} repeats")
    print("| configuration | tok/s median (min-max) | x one at a time | TPOT ms (median request) | "
          "TTFT s (median request) | rows per stage step | stage utilization | tokens = one at a time |")
    print("|---|---|---|---|---|---|---|---|")
    for c in configs:
        rs = runs[c]
        rates = [r["tokens_s"] for r in rs]
        med, lo, hi = statistics.median(rates), min(rates), max(rates)
        same = sum(a == b for a, b in zip(rs[-1]["tokens"], want))
        u = rs[-1]["utilization"]
        print(f"| {c} | {med:.2f} ({lo:.2f}-{hi:.2f}) | {med / base:.2f} | "
              f"{statistics.median(r['tpot_ms'] for r in rs):.1f} | {statistics.median(r['ttft_s'] for r in rs):.2f} | "
              f"{rs[-1]['rows_per_step']:.2f} | {format_utilization(u) if u is not None else '-'} | "
              f"{same}/{len(want)} |")
    print("\nper tick, last repeat (a tick of the batch run carries every live request's token):")
    print("| configuration | ms per tick | stage compute ms per step | driver PDM ms per tick |")
    print("|---|---|---|---|")
    for c in configs:
        r = runs[c][-1]
        print(f"| {c} | {r['tick_ms']:.1f} | {' / '.join(f'{x:.1f}' for x in r['stage_ms'])} | {r['pdm_ms']:.1f} |")
    return 0

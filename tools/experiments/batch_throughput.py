"""Several requests in the pipeline (docs/design.md 3.12): throughput, per-request latency and
stage utilization against B, in one launch of the ranks.

    spd measure batch-throughput --requests 8 --batches 1,2,4 --repeats 3 -- \\
        --model smollm2-135m --stages 2 --colocate --prompts-file train/evalsets/mt_bench.jsonl \\
        --chat --max-new-tokens 64

Arguments after `--` are `spd generate`'s (model, topology, head, prompts). The first `--requests`
prompts are all submitted at tick 1; each repeat runs them once one at a time with the single-request
path (`generate`, as `spd generate` without --max-batch) and once per B with `generate_batch`, the
configurations in a rotated order per repeat so drift over the run touches each alike. Reported per
configuration: what bench/batch_speed.py measures (throughput, latency and utilization against B;
`spd bench --max-batch` reports the same beside its other rows).
"""
from __future__ import annotations

import argparse
import sys


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


def main(argv: list[str] | None = None) -> int:
    from spd_engine.bench.batch_speed import format_summary, measure_batches, summary
    from spd_engine.engine.model.tokenizer import Tokenizer
    from spd_engine.engine.runtime.batch_driver import BatchRequest
    from spd_engine.engine.runtime.launch import launch
    from spd_engine.engine.runtime.request_inputs import encode_prompts
    from spd_engine.engine.runtime.run_config import Mode
    from spd_engine.tools.engine_args import engine_config
    from spd_engine.tools.prompt_args import load_prompts

    args, gen = _args(sys.argv[1:] if argv is None else argv)
    ecfg, tok_dir = engine_config(gen)
    if ecfg.mode is not Mode.SPD:
        raise ValueError(f"batch-throughput measures SPD (--mode spd), got --mode {ecfg.mode}")
    tok = Tokenizer.from_dir(tok_dir) if tok_dir is not None else None
    texts = load_prompts(gen)
    texts = [texts[i % len(texts)] for i in range(args.requests)]
    prompts = encode_prompts(texts, tok, gen.chat, ecfg.model.cfg.vocab_size)
    eos = () if gen.ignore_eos else (tok.eos_ids if tok is not None else ecfg.model.cfg.eos_token_ids)
    reqs = [BatchRequest(ids, gen.max_new_tokens, eos) for ids in prompts]
    with launch(ecfg) as runtime:
        runs = measure_batches(runtime, reqs, args.batch_list, args.repeats,
                               lambda m: print(m, file=sys.stderr, flush=True))
    topo = ecfg.parallel.topology
    print(f"model {ecfg.model.source}, head {ecfg.drafting.pdm}, n={topo.n}, colocate={topo.colocate}, "
          f"{args.requests} requests x {gen.max_new_tokens} tokens, {args.repeats} repeats")
    print("\n".join(format_summary(summary(runs))))
    return 0

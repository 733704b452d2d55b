"""`spd generate`: text generation with SPD or a baseline (ar, pp), streamed as tokens commit.

Starts its own ranks (one process each), or runs under `torchrun` (single or multi-node) when
RANK/WORLD_SIZE are set. Text is streamed without special tokens (EOS, <|im_end|>: as HF's
skip_special_tokens). With --json, one JSON line per prompt follows the text (or goes to FILE):
the text, the token ids, the model and the head used, and the run's stats.
Prompts: --prompt, --prompts-file, or --messages-file (multi-turn chats through the chat template).
The tokenizer is the model's own, or --tokenizer PATH; a model without one is refused (only
`random:<preset>` models map prompt bytes into their vocabulary).

Sampling: the model's generation_config.json (next to its tokenizer) gives the defaults, read the
way HF `generate` reads it (no `do_sample`: greedy; filters it leaves out take HF's defaults,
top-k 50 and top-p 1); --temperature, --top-k, --top-p and --sampling-seed override it. Without
that file the default is greedy and unset filters are off. Draws are keyed by
(seed, position, purpose), so a seed repeats its text for one configuration (mode, n, head),
whether the ranks are threads or processes; another configuration draws other, equally exact
samples (SPD's drafts depend on n and the head, and ar / pp draw without drafts).
--repetition-penalty, --presence-penalty, --frequency-penalty and --min-tokens (vLLM's) change the
target's logits before temperature and the filters (--mode spd).
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

from spd_engine.engine.protocol.batch_schedule import format_utilization
from spd_engine.engine.protocol.sampling import SamplingParams
from spd_engine.engine.runtime.request_inputs import encode_prompts, sampling_params
from spd_engine.engine.runtime.run_config import Mode, random_preset
from spd_engine.tools.cli_conventions import add_batch_arguments, add_json_argument, check_batch_arguments, check_output_path
from spd_engine.tools.engine_args import add_engine_arguments, engine_config
from spd_engine.tools.model_args import text_needs_tokenizer
from spd_engine.tools.prompt_args import add_request_arguments, load_prompts


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_engine_arguments(p)
    g = p.add_argument_group("request")
    add_request_arguments(g)
    add_json_argument(g, "per prompt: text, token ids, model, head and stats (one line each)")
    g.add_argument("--quiet", action="store_true", help="do not stream text, nor the summary line on stderr")
    add_batch_arguments(g, "prompts (each answer prints when all are done, then one summary line of the run)")
    g.add_argument("--ignore-eos", action="store_true",
                   help="generate --max-new-tokens tokens, past EOS (as vLLM's ignore_eos: benchmarks)")
    s = p.add_argument_group("sampling", "each default: the model's generation_config.json read as HF does (no "
                             "do_sample: greedy; unset filters: top-k 50, top-p 1), else greedy")
    s.add_argument("--temperature", type=float, default=None, help="0 = greedy; > 0 samples")
    s.add_argument("--top-k", type=int, default=None, help="keep the k most likely tokens (0 = off)")
    s.add_argument("--top-p", type=float, default=None, help="keep the smallest head with mass > p, in (0, 1]")
    s.add_argument("--sampling-seed", type=int, default=None,
                   help="seed of the keyed random draws (--seed seeds random weights and untrained heads)")
    s.add_argument("--repetition-penalty", type=float, default=None,
                   help="vLLM's: > 0, 1 = off; prompt and output tokens' logits divided (> 0) or multiplied")
    s.add_argument("--presence-penalty", type=float, default=None, help="in [-2, 2]; 0 = off; over output tokens")
    s.add_argument("--frequency-penalty", type=float, default=None,
                   help="in [-2, 2]; 0 = off; times each output token's count")
    s.add_argument("--min-tokens", type=int, default=None, help="EOS held back until this many tokens (--mode spd)")


def sampling_overrides(args: argparse.Namespace) -> dict:
    """The sampling flags given on the command line (None = not given)."""
    return dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.sampling_seed,
                repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
                frequency_penalty=args.frequency_penalty, min_tokens=args.min_tokens)


def sampling_json(sampling: SamplingParams) -> dict:
    """The record's sampling: temperature, top_k, top_p and seed, and the penalties and min_tokens where set."""
    neutral = asdict(SamplingParams())
    return {k: v for k, v in asdict(sampling).items()
            if k in ("temperature", "top_k", "top_p", "seed") or v != neutral[k]}


def result_json(i: int, ecfg, res, tok, sampling: SamplingParams) -> dict:
    """The --json record of one prompt: what was generated, by which model and head, and the stats."""
    topo = ecfg.parallel.topology
    return {"prompt": i, "text": tok.text(res.tokens) if tok is not None else None, "token_ids": list(res.tokens),
            "model": ecfg.model.source, "head": {"spd": ecfg.drafting.pdm, "eagle": ecfg.drafting.eagle_head}.get(ecfg.mode),
            "mode": ecfg.mode, "n": topo.n, "tp": topo.tp, "colocate": topo.colocate, "sampling": sampling_json(sampling),
            **res.to_json()}


def run(args: argparse.Namespace) -> int:
    from spd_engine.engine.model.tokenizer import IncrementalDetokenizer, Tokenizer
    from spd_engine.engine.runtime.launch import launch

    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    check_batch_arguments(args)
    sampling_params(sampling_overrides(args), None)  # bad flags fail before any model is loaded
    texts = load_prompts(args)
    check_output_path(args.json, "--json")  # before the model is converted or a rank starts
    ecfg, tok_dir = engine_config(args)
    sampling = sampling_params(sampling_overrides(args), tok_dir)
    if ecfg.mode is not Mode.SPD and sampling.seed >= 1 << 63:
        raise ValueError(f"--sampling-seed must be below 2**63 with --mode {ecfg.mode}, got {sampling.seed}")
    tok = Tokenizer.from_dir(tok_dir) if tok_dir is not None else None
    if tok is None and random_preset(ecfg.model.source) is None:  # never a silent byte encoding of real weights' prompts
        raise ValueError(text_needs_tokenizer(args.model))
    if args.chat and tok is None:
        raise ValueError(f"--chat needs a model with a tokenizer and a chat template; {args.model} has no tokenizer")
    prompts = encode_prompts(texts, tok, args.chat, ecfg.model.cfg.vocab_size)
    if any(not ids for ids in prompts):
        raise ValueError(f"prompt {next(i for i, ids in enumerate(prompts) if not ids) + 1} encodes to no tokens")
    eos = tok.eos_ids if tok is not None else ecfg.model.cfg.eos_token_ids
    if args.ignore_eos:
        eos = ()
    for ids in prompts:
        if len(ids) + args.max_new_tokens > ecfg.runtime.capacity:
            raise ValueError(f"prompt ({len(ids)} tokens) + --max-new-tokens {args.max_new_tokens} exceeds "
                             f"--capacity {ecfg.runtime.capacity}")
    if (ecfg.drafting.pdm if ecfg.mode is Mode.SPD else ecfg.drafting.eagle_head if ecfg.mode is Mode.EAGLE else "") == "random":
        print(f"spd: no trained {ecfg.mode} head for this model and n; using an untrained one (lossless, but slow)",
              file=sys.stderr)
    if args.max_batch > 1 and ecfg.mode is not Mode.SPD:
        raise ValueError(f"--max-batch > 1 needs --mode spd, got --mode {ecfg.mode}")
    records = []
    with launch(ecfg) as runtime:
        if args.max_batch > 1:
            records = _generate_batch(args, runtime, ecfg, tok, prompts, eos, sampling)
            prompts = []
        for i, ids in enumerate(prompts):
            if len(prompts) > 1:
                print(f"[{i + 1}/{len(prompts)}]", file=sys.stderr, flush=True)
            detok = IncrementalDetokenizer(tok, skip_special_tokens=True) if tok is not None and not args.quiet else None
            on_token = (lambda t, d=detok: print(d.push(t), end="", flush=True)) if detok else None
            res = runtime.generate(ids, args.max_new_tokens, eos, on_token=on_token, sampling=sampling)
            if detok is not None:
                print(detok.flush(), flush=True)
            elif not args.quiet:
                print(res.tokens, flush=True)
            if not args.quiet:  # what the run did, beside the text
                print(f"spd: {res.summary(ecfg.mode)}", file=sys.stderr, flush=True)
            if args.json == "-":
                print(json.dumps(result_json(i, ecfg, res, tok, sampling)), flush=True)
            elif args.json:
                records.append(result_json(i, ecfg, res, tok, sampling))
    if records:
        Path(args.json).write_text("".join(json.dumps(r) + "\n" for r in records))
    return 0


def _generate_batch(args: argparse.Namespace, runtime, ecfg, tok, prompts: list[list[int]], eos,
                    sampling: SamplingParams) -> list[dict]:
    """Every prompt through the pipeline, up to --max-batch at once; answers print in order."""
    from spd_engine.engine.runtime.batch_driver import BatchRequest

    out = runtime.generate_batch([BatchRequest(ids, args.max_new_tokens, eos, sampling) for ids in prompts],
                                 args.max_batch, max_rows=args.max_rows)
    records = []
    for i, res in enumerate(out.results):
        if not args.quiet:
            print(f"[{i + 1}/{len(prompts)}]", file=sys.stderr, flush=True)
            print(tok.text(res.tokens) if tok is not None else res.tokens, flush=True)
            print(f"spd: {res.summary(ecfg.mode)}", file=sys.stderr, flush=True)
        if args.json == "-":
            print(json.dumps(result_json(i, ecfg, res, tok, sampling)), flush=True)
        elif args.json:
            records.append(result_json(i, ecfg, res, tok, sampling))
    if not args.quiet:
        print(f"spd: {len(prompts)} requests at B={args.max_batch}: {out.tokens} tokens in {out.wall_s:.2f} s, "
              f"{out.tokens_per_s:.1f} tok/s; {out.ticks} ticks, "
              f"stage utilization {format_utilization(out.utilization)}", file=sys.stderr, flush=True)
    return records

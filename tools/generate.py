"""`spd generate`: text generation with SPD or a baseline (ar, pp), streamed as tokens commit.

Starts its own ranks (one process each), or runs under `torchrun` (single or multi-node) when
RANK/WORLD_SIZE are set. With --json, per-run stats follow the text as one JSON line per prompt.
"""
from __future__ import annotations

import argparse
import json
import sys

from tools.common import add_engine_arguments, engine_config, load_prompts


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_engine_arguments(p)
    g = p.add_argument_group("request")
    g.add_argument("--prompt", action="append", help="prompt text (repeatable)")
    g.add_argument("--prompts-file", help="one prompt per line, or jsonl ('prompt' or EAGLE 'turns')")
    g.add_argument("--max-new-tokens", type=int, default=64)
    g.add_argument("--chat", action="store_true", help="apply the model's chat template")
    g.add_argument("--json", action="store_true", help="print per-run stats as JSON lines")
    g.add_argument("--quiet", action="store_true", help="do not stream text")


def encode_prompts(texts: list[str], tok, chat: bool, vocab_size: int) -> list[list[int]]:
    if tok is None:  # random-weight models have no tokenizer: map bytes into the vocabulary
        return [[3 + b % (vocab_size - 3) for b in t.encode()] for t in texts]
    return [tok.chat_ids(t) if chat else tok.encode(t) for t in texts]


def run(args: argparse.Namespace) -> int:
    from engine.launch import launch
    from engine.tokenizer import IncrementalDetokenizer, Tokenizer

    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    texts = load_prompts(args)
    ecfg, tok_dir = engine_config(args)
    tok = Tokenizer.from_dir(tok_dir) if tok_dir is not None else None
    prompts = encode_prompts(texts, tok, args.chat, ecfg.cfg.vocab_size)
    eos = tok.eos_ids if tok is not None else ecfg.cfg.eos_token_ids
    for ids in prompts:
        if len(ids) + args.max_new_tokens > ecfg.capacity:
            raise ValueError(f"prompt ({len(ids)} tokens) + --max-new-tokens {args.max_new_tokens} exceeds "
                             f"--capacity {ecfg.capacity}")
    if ecfg.pdm == "random" and ecfg.mode == "spd":
        print("spd: no trained head for this model and n; using an untrained one (lossless, but slow)",
              file=sys.stderr)
    with launch(ecfg) as runtime:
        for i, ids in enumerate(prompts):
            if len(prompts) > 1:
                print(f"[{i + 1}/{len(prompts)}]", file=sys.stderr, flush=True)
            detok = IncrementalDetokenizer(tok) if tok is not None and not args.quiet else None
            on_token = (lambda t, d=detok: print(d.push(t), end="", flush=True)) if detok else None
            res = runtime.generate(ids, args.max_new_tokens, eos, on_token=on_token)
            if detok is not None:
                print(detok.flush(), flush=True)
            elif not args.quiet:
                print(res.tokens, flush=True)
            if args.json:
                print(json.dumps({"prompt": i, "mode": ecfg.mode, "n": ecfg.topology.n,
                                  "colocate": ecfg.topology.colocate, **res.to_json()}), flush=True)
    return 0

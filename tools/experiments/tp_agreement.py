"""Greedy decoding with a tensor-parallel split against unsharded greedy decoding, on the eval
prompts: how many outputs part, where, and how close the two tokens were there.

    spd measure tp-agreement [--model smollm2-135m] [--tp 3] [--limit 10] [--max-new-tokens 64]

`--model`: the built-in name (fetched and converted into the cache as `spd fetch-model` does),
or `random:<preset>`.

The split's greedy decoder is engine/model/tp_model.py `SerialTP` (the runtime's arithmetic, shards in
one thread; vocab-parallel head). A TP split only changes the order in which each layer's sums
are added, so the logits move in their last bits and an argmax can flip only where the top two
logits nearly tie; after such a flip the two outputs continue from different contexts. At each
parting this prints the unsharded logits' gap between the two tokens (teacher-forced on the
common prefix), and, teacher-forced over each unsharded output, the largest logit difference
between the two computations and the positions whose top two unsharded logits are closer than
twice it (the near-ties where a parting could happen).
"""
from __future__ import annotations

import argparse
import sys

import torch

from spd_engine.engine.model.greedy import greedy_generate, prefill
from spd_engine.engine.model.tp_model import SerialTP
from spd_engine.engine.protocol.topology import Topology
from spd_engine.engine.runtime.build import build_stage_model, build_tp_stage_model
from spd_engine.engine.runtime.run_config import ModelSpec, ParallelLayout, RunConfig, Runtime, random_preset
from spd_engine.tools.cli import HelpFormatter

SETS = ("mt_bench", "humaneval", "gsm8k")


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), None)


@torch.no_grad()
def compare(ecfg: RunConfig, prompts: list[list[int]], max_new: int, eos) -> list[dict]:
    L = ecfg.model.cfg.num_layers
    full = build_stage_model(ecfg, range(L), True, True)
    split = SerialTP.build(lambda g: build_tp_stage_model(ecfg, range(L), True, True, g), ecfg.parallel.topology.tp)
    out = []
    for ids in prompts:
        want = greedy_generate(full, ids, max_new, eos)
        got = greedy_generate(split, ids, max_new, eos)
        k = first_difference(got, want)
        # teacher-forced over prompt + the unsharded output: how far apart the two logits are, and
        # at how many positions the top two unsharded logits are closer than twice that (near-ties)
        seq = torch.tensor([ids + want[:-1]])
        a = full.logits(full.forward_layers(full.embed(seq), full.new_cache(1, seq.shape[1]), 0)[0])[0, len(ids) - 1:]
        b = split.logits(split.forward_layers(split.embed(seq), split.new_cache(1, seq.shape[1]), 0)[0])[0, len(ids) - 1:]
        diff = float((a - b).abs().max())
        top = a.topk(2, dim=-1).values
        row = {"tokens": len(want), "parts_at": k, "max_logit_diff": diff,
               "near_ties": int((top[:, 0] - top[:, 1] <= 2 * diff).sum())}
        if k is not None:
            logits = full.logits(prefill(full, full.new_cache(1, len(ids) + k), ids + want[:k]))
            row["gap"] = float(logits[want[k]] - logits[got[k]])
            row["top2_margin"] = float(logits.topk(2).values[0] - logits.topk(2).values[1])
        out.append(row)
    return out


def resolve(model: str) -> tuple[str, object]:
    """(engine checkpoint dir or random:<preset>, tokenizer or None)."""
    from spd_engine.checkpoint_tools import convert_cache
    from spd_engine.checkpoint_tools.fetch import cache_root, fetch_model
    from spd_engine.engine.model.tokenizer import Tokenizer

    if random_preset(model) is not None:
        return model, None
    hf_dir = fetch_model(model)
    return str(convert_cache.engine_checkpoint(hf_dir, model, cache_root())), Tokenizer.from_dir(hf_dir)


def main(argv: list[str] | None = None) -> int:
    from spd_engine.engine.model.checkpoint import read_index
    from spd_engine.train.evaluate import default_data_dir, encode_prompt, load_dataset

    p = argparse.ArgumentParser(prog="spd measure tp-agreement", description=__doc__.splitlines()[0],
                                formatter_class=HelpFormatter)
    p.add_argument("--model", default="smollm2-135m", help="the model (a built-in name, directory or spec)")
    p.add_argument("--tp", type=int, default=3, help="TP ranks T of the split (must divide the heads and KV heads)")
    p.add_argument("--limit", type=int, default=10, help="prompts per eval set")
    p.add_argument("--max-new-tokens", type=int, default=64, help="greedy tokens per prompt")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads per rank")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="weights and compute dtype")
    args = p.parse_args(argv)
    try:
        spec, tok = resolve(args.model)
        cfg = random_preset(spec) or read_index(spec).cfg
        ecfg = RunConfig(model=ModelSpec(source=spec, cfg=cfg, dtype=args.dtype),
                         parallel=ParallelLayout(topology=Topology.build(cfg.num_layers, 1, colocate=True, tp=args.tp)),
                         mode="tp", runtime=Runtime(capacity=min(2048, cfg.max_position)))
    except ValueError as err:
        print(f"tp_agreement: {err}", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    eos = tok.eos_ids if tok is not None else cfg.eos_token_ids
    total = parted = 0
    for name in SETS:
        prompts = [encode_prompt(q.text, tok, cfg.vocab_size) for q in load_dataset(default_data_dir(), name, args.limit)]
        rows = compare(ecfg, prompts, args.max_new_tokens, eos)
        part = [r for r in rows if r["parts_at"] is not None]
        total, parted = total + len(rows), parted + len(part)
        print(f"{name}: {len(part)} of {len(rows)} outputs part from unsharded greedy "
              f"({sum(r['tokens'] for r in rows)} unsharded tokens; max |logit diff| "
              f"{max(r['max_logit_diff'] for r in rows):.2e}, near-ties within twice it: "
              f"{sum(r['near_ties'] for r in rows)})" +
              "".join(f"; at token {r['parts_at']}: logit gap {r['gap']:.2e} (top-2 margin {r['top2_margin']:.2e})"
                      for r in part))
    print(f"overall: {parted} of {total} outputs part, tp={args.tp}, {args.max_new_tokens} new tokens, "
          f"{ecfg.model.dtype}")
    return 0


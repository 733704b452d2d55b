"""PDM step time with and without a draft vocabulary: the driver's step (n + 1 rows through the K
layers, the draft head, argmax) on random weights of a preset's shape, the two heads timed
back to back in alternation so host drift hits both alike. With `--precisions`, the
draft-vocabulary head instead in each of float32, bfloat16 and int8 (`--pdm-dtype`'s forms:
engine/model/draft_stack.py), in alternation.

    spd measure pdm-vocab-time --draft-vocab dv8k.json [--preset smollm2-135m] [--pdm-layers 2]
    spd measure pdm-vocab-time --draft-vocab dv8k.json --stage-layers 15,15 --pdm-layers 2 --precisions
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from spd_engine.engine.model.pdm import random_pdm
from spd_engine.engine.runtime.run_config import PRESETS
from spd_engine.tools.cli import HelpFormatter

PRECISIONS = ("float32", "bfloat16", "int8")


def in_precision(pdm, precision: str):
    """The PDM with its body and head in `precision` (as build_pdm makes them)."""
    if precision == "int8":
        pdm.use_int8_matmuls()
    elif precision == "bfloat16":
        pdm.set_compute_dtype(torch.bfloat16)
    return pdm


@torch.no_grad()
def time_heads(preset: str, stage_layers: tuple[int, ...], K: int, draft_vocab: tuple[int, ...],
               pos: int = 300, iters: int = 60, warmup: int = 10, precisions: bool = False) -> dict[str, float]:
    """Median ms per PDM step for {'draft_vocab': ..., 'full': ...}, or with `precisions` for the
    draft-vocabulary head in each of PRECISIONS."""
    cfg = PRESETS[preset]
    if precisions:
        heads = {p: in_precision(random_pdm(cfg, stage_layers, num_layers=K, draft_vocab=draft_vocab), p).eval()
                 for p in PRECISIONS}
    else:
        heads = {"draft_vocab": random_pdm(cfg, stage_layers, num_layers=K, draft_vocab=draft_vocab).eval(),
                 "full": random_pdm(cfg, stage_layers, num_layers=K).eval()}
    caches = {k: p.new_cache(pos + len(stage_layers) + 1) for k, p in heads.items()}
    rows = torch.randn(1, len(stage_layers) + 1, cfg.hidden_size)  # [1, n+1, H]
    times: dict[str, list[float]] = {k: [] for k in heads}
    for _ in range(warmup + iters):
        for k, pdm in heads.items():
            t0 = time.perf_counter()
            h = pdm.forward_rows(rows, caches[k], pos)
            int(pdm.draft_logits(h[0, -1]).argmax())  # host sync: the draft id, as the driver needs it
            times[k].append(time.perf_counter() - t0)
    return {k: 1e3 * statistics.median(v[warmup:]) for k, v in times.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="spd measure pdm-vocab-time", description=__doc__.splitlines()[0],
                                formatter_class=HelpFormatter)
    p.add_argument("--draft-vocab", required=True, help="JSON from `spd draft-vocab`")
    p.add_argument("--preset", default="smollm2-135m", choices=sorted(PRESETS), help="the model shape (random weights)")
    p.add_argument("--stage-layers", default="8,8,7,7", help="the stage split the PDM's anchors follow")
    p.add_argument("--pdm-layers", default="1,2", help="K values to time")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--precisions", action="store_true", help=f"time the draft-vocabulary head in each of {PRECISIONS}")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    from spd_engine.train.draft_vocab_build import load_draft_vocab

    try:
        dv = tuple(load_draft_vocab(args.draft_vocab))
    except (OSError, ValueError, KeyError) as err:
        p.error(f"--draft-vocab {args.draft_vocab}: {err}")
    layers = tuple(int(x) for x in args.stage_layers.split(","))
    for K in (int(x) for x in args.pdm_layers.split(",")):
        t = time_heads(args.preset, layers, K, dv, precisions=args.precisions)
        if args.precisions:
            print(f"K={K}, {len(dv)} draft ids, {len(layers) + 1} rows: " + ", ".join(
                f"{p} {t[p]:.2f} ms" for p in PRECISIONS) + f" per PDM step ({args.threads} thread(s))")
            continue
        print(f"K={K}: draft vocabulary ({len(dv)} ids) {t['draft_vocab']:.2f} ms, full vocabulary "
              f"({PRESETS[args.preset].vocab_size} ids) {t['full']:.2f} ms per PDM step, "
              f"ratio {t['full'] / t['draft_vocab']:.2f}x ({args.threads} thread(s))")
    return 0


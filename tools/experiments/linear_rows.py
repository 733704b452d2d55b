"""The time of the model's linear layers on R rows against one row: what a stage step over several
requests' tokens (docs/design.md 3.12) or W chains (3.11) pays in its matmuls on this device.

    spd measure linear-rows --model smollm2-135m --rows 1,2,3,4,8 --threads 1

Random weights of the model's shapes (the attention's QKV and output projections, the MLP's
input and output, the LM head), fp32 on the CPU; each shape's row counts in alternation, medians
of `--repeats` timed calls after warm-up.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from spd_engine.tools.cli import HelpFormatter


def shapes(cfg) -> dict[str, tuple[int, int]]:
    """name -> (in, out) of each linear layer of a decoder layer, and the head."""
    return {"qkv": (cfg.hidden_size, cfg.qkv_rows), "attn out": (cfg.num_heads * cfg.head_dim, cfg.hidden_size),
            "mlp in": (cfg.hidden_size, 2 * cfg.intermediate_size), "mlp out": (cfg.intermediate_size, cfg.hidden_size),
            "head": (cfg.hidden_size, cfg.vocab_size)}


def time_us(w: torch.Tensor, rows: list[int], repeats: int) -> dict[int, float]:
    xs = {r: torch.randn(r, w.shape[1]) for r in rows}
    for r in rows:  # warm-up
        for _ in range(5):
            torch.nn.functional.linear(xs[r], w)
    samples: dict[int, list[float]] = {r: [] for r in rows}
    for _ in range(repeats):
        for r in rows:
            t0 = time.perf_counter()
            torch.nn.functional.linear(xs[r], w)
            samples[r].append(time.perf_counter() - t0)
    return {r: 1e6 * statistics.median(v) for r, v in samples.items()}


def main(argv: list[str] | None = None) -> int:
    from spd_engine.tools.model_args import model_config, resolve_model

    p = argparse.ArgumentParser(prog="spd measure linear-rows", description=__doc__.split("\n\n")[0],
                                formatter_class=HelpFormatter)
    p.add_argument("--model", default="smollm2-135m", help="a model spec (its shapes; weights are random)")
    p.add_argument("--rows", default="1,2,3,4,8", help="row counts R")
    p.add_argument("--repeats", type=int, default=50, help="timed calls per row count (the median is shown)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    rows = [int(r) for r in args.rows.split(",") if r.strip()]
    if not rows or min(rows) < 1 or args.repeats < 1 or args.threads < 1:
        raise ValueError("--rows, --repeats and --threads must be >= 1")
    torch.set_num_threads(args.threads)
    cfg = model_config(resolve_model(args.model)[0])
    print(f"{args.model}, {args.threads} thread(s), fp32, medians of {args.repeats}: us per call (x one row)")
    print("| layer (in x out) | " + " | ".join(f"{r} rows" for r in rows) + " |")
    print("|---|" + "---|" * len(rows))
    for name, (k, n) in shapes(cfg).items():
        t = time_us(torch.randn(n, k), rows, args.repeats)
        print(f"| {name} ({k} x {n}) | " + " | ".join(f"{t[r]:.0f} ({t[r] / t[rows[0]]:.2f})" for r in rows) + " |")
    return 0

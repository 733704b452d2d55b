"""Time of one `spd train` step's forward + backward on random weights of a preset's shape: the
frozen target's forward (anchors + teacher) and the PDM's simulation at a fill, per PDM depth K
and autocast dtype, each configuration timed in alternation so host drift hits all alike.

    spd measure train-step-time [--preset smollm2-135m] [--stages 4] [--pdm-layers 1,2] [--fills 1,4]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from spd_engine.engine.model.model import StageModel, init_random_
from spd_engine.engine.protocol.topology import Topology
from spd_engine.engine.runtime.run_config import PRESETS
from spd_engine.tools.cli import HelpFormatter
from spd_engine.train.distill import TrainConfig, distill_loss, new_pdm


def time_steps(preset: str, n: int, Ks: list[int], fills: list[int], autocasts: list[str], batch: int,
               seq: int, iters: int = 3) -> dict[tuple[int, int, str], float]:
    """Median seconds of distill_loss + backward per (K, fill, autocast)."""
    cfg = PRESETS[preset]
    target = init_random_(StageModel(cfg, range(cfg.num_layers), embedding=True, head=True)).to(torch.bfloat16).eval()
    for p in target.parameters():
        p.requires_grad_(False)
    layers = tuple(Topology.build(cfg.num_layers, n).stage_layers)
    pdms = {K: new_pdm(target, TrainConfig(out="-", stage_layers=layers, pdm_layers=K), None).train() for K in Ks}
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))
    keys = [(K, f, a) for K in Ks for f in fills for a in autocasts]
    times: dict[tuple[int, int, str], list[float]] = {k: [] for k in keys}
    for i in range(iters + 1):  # the first round warms up
        for K, f, a in keys:
            t0 = time.perf_counter()
            loss, _ = distill_loss(pdms[K], target, tokens, f, a)
            loss.backward()
            if i:
                times[(K, f, a)].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="spd measure train-step-time", description=__doc__.splitlines()[0],
                                formatter_class=HelpFormatter)
    p.add_argument("--preset", default="smollm2-135m", choices=sorted(PRESETS), help="the target shape (random weights)")
    p.add_argument("--stages", type=int, default=4, help="pipeline stages n the head is for")
    p.add_argument("--pdm-layers", default="1,2", help="PDM depths K to time")
    p.add_argument("--fills", default="1,4", help="pipeline fills to simulate, each in 1..n")
    p.add_argument("--autocast", default="bfloat16,float32", help="autocast dtypes to time (bfloat16, float16, float32)")
    p.add_argument("--batch", type=int, default=4, help="sequences per step")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per sequence")
    p.add_argument("--iters", type=int, default=3, help="timed steps per configuration (the median is shown)")
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    ints = lambda text: [int(x) for x in text.split(",")]  # noqa: E731
    fills = ints(args.fills)
    if any(not 1 <= f <= args.stages for f in fills) or args.batch < 1 or args.seq_len < 2 or args.iters < 1:
        p.error(f"fills must be in 1..{args.stages}; batch >= 1, seq-len >= 2, iters >= 1")
    autocasts = args.autocast.split(",")
    if any(a not in ("bfloat16", "float16", "float32") for a in autocasts):
        p.error(f"--autocast takes bfloat16, float16, float32; got {args.autocast}")
    res = time_steps(args.preset, args.stages, ints(args.pdm_layers), fills, autocasts, args.batch, args.seq_len,
                     args.iters)
    print(f"{args.preset}, n={args.stages}, batch {args.batch} x {args.seq_len}, target bf16, "
          f"{args.threads} threads, median of {args.iters}")
    for (K, f, a), s in res.items():
        print(f"K={K} fill={f} autocast={a}: {s:.3f} s forward + backward")
    return 0


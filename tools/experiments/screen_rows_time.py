"""The head screen's product for R rows at once (a suffix run's exit rows, a batch's): the bf16
kernel (`torch._weight_int8pack_mm`, with its bounds) against the int8 x int8 one of two digits
per row (`ScreenedHead.bounds_rows`), on random weights of a preset's head shape, the two timed in
alternation so host drift hits both alike. What `screened_argmax.ROWS_INT8_MIN` is chosen from.

    spd measure screen-rows-time [--preset smollm2-135m | --shape V,H] [--rows 1,2,4,6,8] [--threads 1]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from spd_engine.engine.runtime.run_config import PRESETS
from spd_engine.kernels.screened_argmax import ScreenedHead, supported
from spd_engine.tools.cli import HelpFormatter


@torch.no_grad()
def time_rows(V: int, H: int, rows: list[int], iters: int = 40, warmup: int = 5) -> dict[int, tuple[float, float]]:
    """Median ms per product {R: (bf16 kernel, int8 x int8)} for a head of V x H."""
    weight = 0.02 * torch.randn(V, H, generator=torch.Generator().manual_seed(0))
    if not supported(weight) or not hasattr(torch, "_int_mm"):
        raise ValueError(f"the screen's kernels do not run here (hidden {H}, torch {torch.__version__})")
    screen = ScreenedHead(weight)
    out = {}
    for R in rows:
        h = torch.randn(R, H)  # [R, H]
        times: tuple[list[float], list[float]] = ([], [])
        for i in range(warmup + iters):
            for k, f in enumerate((lambda: screen.bounds_rows_bf16(h), lambda: screen.bounds_rows(h))):
                t0 = time.perf_counter()
                f()
                if i >= warmup:
                    times[k].append(time.perf_counter() - t0)
        out[R] = (1e3 * statistics.median(times[0]), 1e3 * statistics.median(times[1]))
    return out


def positive_ints(p: argparse.ArgumentParser, flag: str, value: str, count: int | None = None) -> list[int]:
    """A comma-separated list of integers >= 1 (exactly `count` of them when given), else a usage error."""
    try:
        out = [int(x) for x in value.split(",")]
    except ValueError:
        out = []
    if not out or min(out) < 1 or (count is not None and len(out) != count):
        what = f"{count} integers >= 1" if count is not None else "integers >= 1"
        p.error(f"{flag} takes {what}, comma-separated, got {value!r}")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="spd measure screen-rows-time", description=__doc__.splitlines()[0],
                                formatter_class=HelpFormatter)
    p.add_argument("--preset", default="smollm2-135m", choices=sorted(PRESETS), help="the model whose head is timed")
    p.add_argument("--shape", help="V,H: a head of this shape instead of the preset's")
    p.add_argument("--rows", default="1,2,4,6,8", help="row counts R of the product")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = p.parse_args(argv)
    rows = positive_ints(p, "--rows", args.rows)
    cfg = PRESETS[args.preset]
    V, H = positive_ints(p, "--shape", args.shape, 2) if args.shape else (cfg.vocab_size, cfg.hidden_size)
    if args.threads < 1:
        p.error(f"--threads must be >= 1, got {args.threads}")
    torch.set_num_threads(args.threads)
    try:
        result = time_rows(V, H, rows)
    except ValueError as err:
        p.error(str(err))
    print(f"head {V} x {H}, {args.threads} thread(s): ms per product")
    for R, (bf16, int8) in result.items():
        print(f"  {R} row(s): bf16 kernel {bf16:.2f}, int8 x int8 {int8:.2f} ({bf16 / int8:.2f}x)")
    return 0

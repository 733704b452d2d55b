"""Record the fastest weight layout of a model on this CPU, for ranks of the given thread counts,
without a whole benchmark: what `spd bench` does before its rows (docs/design.md 3.14), so that
`--weight-layout auto` in a later `spd generate` or `spd serve` on this host takes it.

    spd measure weight-layouts --model smollm2-135m --threads 1,2
"""
from __future__ import annotations

import argparse
import os
import sys

from spd_engine.tools.cli import HelpFormatter


def main(argv: list[str] | None = None) -> int:
    from spd_engine.tools.measured_args import record_layouts
    from spd_engine.tools.model_args import model_config, resolve_model

    cores = os.cpu_count() or 1
    p = argparse.ArgumentParser(prog="spd measure weight-layouts", description=__doc__.split("\n\n")[0],
                                formatter_class=HelpFormatter)
    p.add_argument("--model", default="smollm2-135m", help="a model spec (its shapes; the timed weights are random)")
    p.add_argument("--threads", default=",".join(map(str, sorted({1, cores}))),
                   help="intra-op thread counts of the ranks to measure for (default: 1 and every core)")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        counts = sorted({int(t) for t in args.threads.split(",") if t.strip()})
    except ValueError:
        p.error(f"--threads takes comma-separated integers, got {args.threads!r}")
    if not counts or counts[0] < 1:
        p.error(f"--threads must name counts >= 1, got {args.threads!r}")
    engine_spec = resolve_model(args.model)[0]
    record_layouts(engine_spec, model_config(engine_spec), "cpu", counts, sys.stdout)
    return 0

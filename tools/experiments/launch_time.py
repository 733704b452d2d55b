"""Bring-up of local ranks: `launch()` with its ranks forked from a forkserver (the default) against
spawned ones, launched twice in one process, each launch serving one short request.

    spd measure launch-time [--model random:tiny-llama] [--stages 4] [--colocate] [--repeats 3]

Each repeat runs each start method in a fresh `spd measure launch-time --one METHOD` process (no
forkserver outlives its repeat), methods alternating. Per method, the median over repeats of the
seconds from `launch()` to the end of its request: the process's first launch (which also starts
the forkserver) and its second. The methods must give the same tokens.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

from spd_engine.tools.cli import HelpFormatter

METHODS = ("spawn", "forkserver")
PROMPT, NEW = [1, 2, 3], 8
TIMEOUT_S = 600  # a run that hangs ends the measurement (subprocess.TimeoutExpired) instead of waiting


def one(model: str, stages: int, colocate: bool, method: str) -> dict:
    """Two launches in this process: their seconds and the last request's tokens."""
    from spd_engine.engine.protocol.topology import Topology
    from spd_engine.engine.runtime.launch import launch
    from spd_engine.engine.runtime.run_config import ModelSpec, ParallelLayout, RunConfig, Runtime, random_preset

    cfg = random_preset(model)
    assert cfg is not None, "main() refuses other models"
    ecfg = RunConfig(model=ModelSpec(source=model, cfg=cfg),
                     parallel=ParallelLayout(topology=Topology.build(cfg.num_layers, stages, colocate=colocate), threads=1),
                     runtime=Runtime(capacity=64, prefill_chunk=16))
    seconds, tokens = [], []
    for _ in range(2):
        t0 = time.perf_counter()
        with launch(ecfg, start_method=method) as runtime:
            tokens = runtime.generate(PROMPT, NEW, ()).tokens
        seconds.append(time.perf_counter() - t0)
    return {"first": seconds[0], "second": seconds[1], "tokens": tokens}


def main(argv: list[str] | None = None) -> int:
    from spd_engine.engine.runtime.launch import spd_command

    p = argparse.ArgumentParser(prog="spd measure launch-time", description=__doc__.splitlines()[0],
                                formatter_class=HelpFormatter)
    p.add_argument("--model", default="random:tiny-llama", help="a random:<preset> model (its weights are built, not read)")
    p.add_argument("--stages", type=int, default=4, help="pipeline stages n (n local ranks, n - 1 with --colocate)")
    p.add_argument("--colocate", action="store_true", help="the driver runs stage 0")
    p.add_argument("--repeats", type=int, default=3, help="fresh processes per method")
    p.add_argument("--one", choices=METHODS, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    from spd_engine.engine.runtime.run_config import random_preset

    if args.stages < 1 or args.repeats < 1:
        p.error("--stages and --repeats must be >= 1")
    if random_preset(args.model) is None:
        p.error(f"--model {args.model}: a random:<preset> model (its weights are built, not read)")
    if args.one is not None:
        print(json.dumps(one(args.model, args.stages, args.colocate, args.one)))
        return 0
    runs: dict[str, list[dict]] = {m: [] for m in METHODS}
    extra = ["--colocate"] if args.colocate else []
    for _ in range(args.repeats):
        for method in METHODS:
            out = subprocess.run([*spd_command(), "measure", "launch-time", "--model", args.model, "--stages",
                                  str(args.stages), *extra, "--one", method], capture_output=True, text=True,
                                 timeout=TIMEOUT_S)
            if out.returncode != 0:
                print(f"launch_time: the {method} run failed:\n{out.stderr[-2000:]}", file=sys.stderr)
                return 1
            runs[method].append(json.loads(out.stdout.splitlines()[-1]))
    if len({tuple(r["tokens"]) for rs in runs.values() for r in rs}) != 1:
        print("launch_time: the runs gave different tokens", file=sys.stderr)
        return 1
    print(f"{args.model}, n={args.stages}{' co-located' if args.colocate else ''}, {args.repeats} repeats "
          "(medians; seconds from launch() to the end of a short request)")
    print("| ranks | first launch | second launch |\n|---|---|---|")
    for method in METHODS:
        first, second = (statistics.median(r[k] for r in runs[method]) for k in ("first", "second"))
        print(f"| {method} | {first:.2f} | {second:.2f} |")
    return 0

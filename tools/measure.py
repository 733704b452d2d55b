"""`spd measure NAME [ARGS...]`: the one-off measurements of tools/experiments/, each behind a name.

Each experiment module exposes `main(argv) -> int` with its own options (`spd measure NAME --help`).
They answer single questions the docs cite (what a W-row stage step costs, how long a host sync
takes, how TP crossings compare); `spd bench`, `spd netbench`, `spd plan` and `spd profile` are
the standing tools.
"""
from __future__ import annotations

import argparse
import importlib

# name -> (module: under spd_engine.tools.experiments, or a dotted path for the measurement
# harnesses that other code uses too, one-line help)
EXPERIMENTS: dict[str, tuple[str, str]] = {
    "batch-throughput": ("batch_throughput", "several requests in the pipeline: tok/s, TPOT, utilization against B"),
    "linear-rows": ("linear_rows", "the model's linear layers on R rows against one row"),
    "pdm-budget": ("pdm_budget", "how many PDM layers K hide behind a stage, on a compute profile"),
    "pdm-vocab-time": ("pdm_vocab_time", "the PDM's step time against the draft vocabulary's size"),
    "stage-width-time": ("spd_engine.bench.stage_width_time", "the cost of a W-row stage step against one row"),
    "screen-rows-time": ("screen_rows_time", "the head screen's product for R rows: bf16 kernel against int8 x int8"),
    "suffix-time": ("suffix_time", "the suffix index's time per tick on cached references"),
    "sync-time": ("spd_engine.bench.sync_time", "the cost of one host sync on a device"),
    "tp-agreement": ("tp_agreement", "greedy tokens of a TP split against the unsharded model"),
    "tp-crossing": ("tp_crossing", "peer sends against a broadcast when states cross a TP stage boundary"),
    "weight-layouts": ("weight_layouts", "record the fastest weight layout of a model on this CPU for --weight-layout auto"),
    "train-step-time": ("train_step_time", "a PDM training step's time by PDM layers and fill"),
    "serve-load": ("serve_load", "concurrent clients against a real `spd serve`: latency, 429s, disconnects"),
    "serve-neighbour": ("serve_neighbour", "a real `spd serve` stream alone and beside a competing neighbour: gaps, "
                                           "run-queue time, stalls"),
    "launch-time": ("launch_time", "local ranks' bring-up: forked from a forkserver against spawned"),
    "serve-overhead": ("serve_overhead", "a request streamed through the server against the same request run directly"),
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    lines = "\n".join(f"  {name:<18} {text}" for name, (_, text) in EXPERIMENTS.items())
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = f"experiments:\n{lines}"
    p.add_argument("name", choices=list(EXPERIMENTS), metavar="NAME", help="the experiment (listed below)")
    p.add_argument("rest", nargs=argparse.REMAINDER, metavar="ARGS", help="the experiment's own options")


def run(args: argparse.Namespace) -> int:
    name = EXPERIMENTS[args.name][0]
    module = importlib.import_module(name if "." in name else f"spd_engine.tools.experiments.{name}")
    return int(module.main(args.rest) or 0)

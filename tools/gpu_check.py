"""`spd gpu-check`: every GPU path checked on one CUDA device in one run (bench/device_check/);
`--dry` runs the same checks on the CPU with tiny shapes. Writes OUT/gpu-check.json and .md.
`--window`: the whole GPU window, the check then head training under a time guard and an
evaluation on the device (OUT/gpu-window.json, .md and the packed heads); `--stage-target GGUF`
cuts the target into the parts a window carries (docs/gpu-check.md, "The GPU window")."""
from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

T0 = time.perf_counter()  # a window's budget counts from the command's start
DEFAULT_CARRY = Path(__file__).resolve().parents[1] / "runs" / "gpu-carry"
CHECK_SHARE = 0.3  # --window --budget-s S: the check's guard gets at most this share of S


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default=None, help="directory for gpu-check.json, gpu-check.md and profiles/ "
                   "(--window: gpu-window.json, .md and gpu-window-files.tar.NN)")
    p.add_argument("--dry", action="store_true", help="the CPU dry run: tiny shapes, the same report keys")
    p.add_argument("--device", default="cuda", help="the CUDA device to check (without --dry)")
    p.add_argument("--window", action="store_true",
                   help="the whole GPU window: the check, then heads trained to the time budget, then evaluated")
    p.add_argument("--budget-s", type=float, default=None,
                   help="seconds for the check's time guard (default 240; dry 50); --window: for the whole "
                        "command, a safety margin included (default 540; dry 90)")
    p.add_argument("--no-check", action="store_true", help="--window: skip the GPU check, train at once")
    p.add_argument("--work", default=None, help="--window: scratch directory (default: a new temporary one)")
    p.add_argument("--carry", default=str(DEFAULT_CARRY),
                   help="--window: the staged target's folder (--stage-target writes it)")
    p.add_argument("--self-distill", type=int, default=None,
                   help="--window: corpus prompts the target answers on the device before training (default: plan's)")
    p.add_argument("--stage-target", default=None, metavar="GGUF",
                   help="cut GGUF into parts under --carry for a window (no device needed)")
    p.add_argument("--part-mib", type=float, default=20.0, help="--stage-target: MiB per part")


def run(args: argparse.Namespace) -> int:
    if args.stage_target:
        return _stage(args)
    if args.out is None:
        raise ValueError("--out is required")
    import torch

    if not args.dry and not (args.device.startswith("cuda") and torch.cuda.is_available()):
        # one line and exit 2 (before any work): the GPU run needs CUDA
        print(f"spd gpu-check: no CUDA device is available to torch {torch.__version__} "
              f"(CUDA build: {torch.version.cuda or 'none'}); run `make gpu-check-dry` for the CPU dry run",
              file=sys.stderr)
        return 2
    if args.budget_s is not None and args.budget_s <= 0:
        raise ValueError(f"--budget-s must be positive, got {args.budget_s}")
    if args.window:
        return _window(args)
    from spd_engine.bench.device_check.check_run import run_check
    from spd_engine.tools.cli import main as spd_main

    report = run_check(args.out, args.dry, lambda m: print(m, flush=True), device=args.device, spd_main=spd_main,
                       budget_s=args.budget_s)
    return 0 if report["summary"]["ok"] else 1


def _window(args: argparse.Namespace) -> int:
    import dataclasses

    from spd_engine.bench.device_check.window_plan import dry_window_plan, gpu_window_plan
    from spd_engine.bench.device_check.window_run import run_window
    from spd_engine.tools.train import batches

    check = not args.no_check
    plan = dry_window_plan(check=check) if args.dry else gpu_window_plan(device=args.device, check=check)
    if args.budget_s is not None:  # a shorter window shortens the check too: training keeps most of it
        plan = dataclasses.replace(plan, budget_s=args.budget_s,
                                   check_budget_s=min(plan.check_budget_s, CHECK_SHARE * args.budget_s))
    if args.self_distill is not None:
        plan = dataclasses.replace(plan, self_distill=max(0, args.self_distill))
    work = args.work or tempfile.mkdtemp(prefix="spd-gpu-window-")
    try:
        report = run_window(args.out, work, plan, args.carry, batches, lambda m: print(m, flush=True), T0)
    finally:
        if args.work is None:  # the training states and the converted target: nothing of them comes back
            shutil.rmtree(work, ignore_errors=True)
    return 0 if report["summary"]["ok"] else 1


def _stage(args: argparse.Namespace) -> int:
    from spd_engine.bench.device_check.window_target import stage_target

    manifest = stage_target(Path(args.stage_target), Path(args.carry), args.part_mib)
    print(f"{args.carry}: {manifest['file']} in {len(manifest['parts'])} parts of at most {args.part_mib:g} MiB "
          f"(sha256 {manifest['sha256'][:16]}...)")
    return 0

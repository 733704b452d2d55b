"""`spd gpu-check`: every GPU path checked on one CUDA device in one run (bench/device_check/);
`--dry` runs the same checks on the CPU with tiny shapes. Writes OUT/gpu-check.json and .md."""
from __future__ import annotations

import argparse
import sys


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, help="directory for gpu-check.json, gpu-check.md and profiles/")
    p.add_argument("--dry", action="store_true", help="the CPU dry run: tiny shapes, the same report keys")
    p.add_argument("--device", default="cuda", help="the CUDA device to check (without --dry)")


def run(args: argparse.Namespace) -> int:
    import torch

    if not args.dry and not (args.device.startswith("cuda") and torch.cuda.is_available()):
        # one line and exit 2 (before any work): the GPU run needs CUDA
        print(f"spd gpu-check: no CUDA device is available to torch {torch.__version__} "
              f"(CUDA build: {torch.version.cuda or 'none'}); run `make gpu-check-dry` for the CPU dry run",
              file=sys.stderr)
        return 2
    from spd_engine.bench.device_check.check_run import run_check
    from spd_engine.tools.cli import main as spd_main

    report = run_check(args.out, args.dry, lambda m: print(m, flush=True), device=args.device, spd_main=spd_main)
    return 0 if report["summary"]["ok"] else 1

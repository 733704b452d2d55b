"""What one host sync costs on a device: the time a device-to-host read of a one-element result
adds after a tiny kernel, the stall the runtime pays for every frame header it reads and every
draft id or argmax it needs on the host (docs/results/tick-cost-2core.md, "Host syncs per decode tick").
The cost model charges it per sync beyond those its measured steps already contain.

    spd measure sync-time [--device cuda]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch


@torch.no_grad()
def host_sync_ms(device: torch.device, iters: int = 200, warmup: int = 20) -> float:
    """Median ms of (enqueue a one-element add, read the result on the host), the queue empty before."""
    x = torch.zeros(1, device=device)
    samples = []
    for i in range(warmup + iters):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        x.add_(1.0)
        float(x.item())  # host sync: what is measured
        if i >= warmup:
            samples.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(samples)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="spd measure sync-time", description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="the device to sync")
    args = p.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is available")
    ms = host_sync_ms(torch.device(args.device))
    print(f"one host sync on {args.device}: {1e3 * ms:.1f} us (median of 200)")
    return 0


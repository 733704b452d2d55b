"""How hidden states should cross a stage boundary under tensor parallelism, measured: two stages
of T ranks each (ranks 0..T-1, then T..2T-1), one [1, H] hidden state per crossing.

- peer: TP rank t sends to TP rank t of the next stage (all T pairs at once); every TP rank of a
  stage holds the full hidden state after its last all-reduce, so nothing else is needed;
- broadcast: TP rank 0 sends one copy to TP rank 0 of the next stage, which broadcasts it over
  its TP group (one collective more on the critical path, T-1 fewer messages on the link).
Time of one crossing: from the senders' post to the moment the last receiving rank holds the
state, the slowest receiving rank's time, over `iters` crossings after `warmup`; one process per
rank, gloo, over the runtime's per-direction P2P groups (engine/comm/transport.py). The runtime uses
`peer` (docs/design.md 3.9).
"""
from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from spd_engine.bench.interconnect import DistContext, launch_local
from spd_engine.tools.cli import HelpFormatter


@dataclass(frozen=True)
class CrossingConfig:
    tp: int = 2
    hidden: int = 576
    dtype_bytes: int = 4
    iters: int = 200
    warmup: int = 20
    timeout_s: float = 30.0


def _crossing_rank(ctx: DistContext, cfg: CrossingConfig) -> dict | None:
    T = cfg.tp
    groups = [dist.new_group(list(range(s * T, (s + 1) * T))) for s in range(2)]
    stage, t = divmod(ctx.rank, T)
    buf = torch.zeros(cfg.hidden * cfg.dtype_bytes // 4, dtype=torch.float32)
    out = {}
    for how in ("peer", "broadcast"):
        times = []
        for i in range(cfg.warmup + cfg.iters):
            ctx.barrier(f"barrier before a {how} crossing")
            t0 = time.perf_counter()
            if how == "peer":
                peer = ctx.rank + T if stage == 0 else ctx.rank - T
                work = ctx.isend(buf, peer) if stage == 0 else ctx.irecv(buf, peer)
                ctx.wait(work, f"{how} crossing")
            else:
                if t == 0:
                    peer = T if stage == 0 else 0
                    work = ctx.isend(buf, peer) if stage == 0 else ctx.irecv(buf, peer)
                    ctx.wait(work, f"{how} crossing")
                if stage == 1:
                    ctx.wait(dist.broadcast(buf, src=T, group=groups[1], async_op=True), "broadcast")
            if i >= cfg.warmup:
                times.append(time.perf_counter() - t0)
        out[how] = times
    gathered = [None] * ctx.world_size if ctx.rank == 0 else None
    dist.gather_object(out if stage == 1 else None, gathered, dst=0)
    if ctx.rank != 0:
        return None
    receivers = [g for g in gathered if g is not None]
    return {how: 1e6 * statistics.median(max(r[how][i] for r in receivers) for i in range(cfg.iters))
            for how in ("peer", "broadcast")}


def measure_crossing(cfg: CrossingConfig) -> dict:
    """{"peer": median us, "broadcast": median us} of one crossing between two T-rank stages."""
    return launch_local(_crossing_rank, cfg, 2 * cfg.tp, "gloo", cfg.timeout_s, 300.0)


def main(argv: list[str] | None = None) -> int:
    """`spd measure tp-crossing [T ...]` (default 2 3): the median crossing time per T."""
    p = argparse.ArgumentParser(prog="spd measure tp-crossing", description=__doc__.splitlines()[0],
                                formatter_class=HelpFormatter)
    p.add_argument("tp", nargs="*", type=int, default=[2, 3], metavar="T",
                   help="TP ranks of each of the two stages, one measurement per value (default: 2 3)")
    for tp in p.parse_args(argv).tp:
        print(f"tp={tp}: median us per crossing {measure_crossing(CrossingConfig(tp=tp))}")
    return 0

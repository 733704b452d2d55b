"""Step time of tensor-parallel shards on this host, all T shards running at once: what a
`--mode tp` rank computes per layer, without its all-reduces (the cost model adds those from
netbench). The cost model's TP row takes it as `tp_layer_ms[T]` (costmodel/cost_alternatives.py).

Each TP rank's shard of the whole model is built as the runtime builds it (engine/runtime/build.py,
its own weights only) in its own process with the run's threads per rank; the T processes
step together (a barrier before the timed loop), so on a host with fewer cores than T they
time-share the cores exactly as the TP ranks of a real run do. The shard's row-parallel
outputs are not reduced (an identity in place of the all-reduce: its values drift, its cost
does not). Mean ms over `steps` one-token decode steps, the slowest rank's mean (a TP step
ends when its last shard does), divided by the layer count.

`lockstep=True` instead runs the shards with their real all-reduces (a gloo group of the T
processes, the runtime's engine/comm/tp_group.py) and subtracts the time each rank spent inside them
(TPGroup.collective_s): the compute between collectives as a TP rank really does it, woken from
a wait at every one of its 2 L reductions, which on a CPU costs more than the same layers run
back to back. The cost model then adds the all-reduces from netbench, once each.
"""
from __future__ import annotations

import multiprocessing as mp
import time

import torch

from spd_engine.engine.comm.tp_group import DistTPGroup, TPGroup
from spd_engine.engine.runtime.run_config import RunConfig


class _ComputeOnly(TPGroup):
    """A TP rank's place in the split without the communication."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size, self.members = rank, size, tuple(range(size))

    def _gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        return [x] * self.size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x


@torch.no_grad()
def _group(tp: int, rank: int, port: int | None, timeout_s: float) -> TPGroup:
    """The shard's TP group: compute only, or (port given) a real gloo group of the T processes."""
    if port is None:
        return _ComputeOnly(rank, tp)
    import datetime

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=tp,
                            timeout=datetime.timedelta(seconds=timeout_s))
    return DistTPGroup(None, range(tp), rank, timeout_s)


def _time_shard(ecfg: RunConfig, tp: int, rank: int, steps: int, warmup: int, barrier, out,
                port: int | None = None, timeout_s: float = 600.0) -> None:
    from spd_engine.engine.runtime.build import build_tp_stage_model

    torch.set_num_threads(ecfg.threads_per_rank(tp))
    L = ecfg.model.cfg.num_layers
    group = _group(tp, rank, port, timeout_s)
    model = build_tp_stage_model(ecfg, range(L), False, False, group)
    cache = model.new_cache(1, warmup + steps + 1)
    h = torch.randn(1, 1, ecfg.model.cfg.hidden_size, generator=torch.Generator().manual_seed(rank)).to(ecfg.model.torch_dtype)
    for pos in range(warmup):
        model.forward_layers(h, cache, pos)
    barrier.wait()
    t0, inside0, calls0 = time.perf_counter(), group.collective_s, group.calls
    for pos in range(warmup, warmup + steps):
        model.forward_layers(h, cache, pos)
    inside, calls = group.collective_s - inside0, group.calls - calls0
    out[rank] = (1e3 * (time.perf_counter() - t0 - inside) / steps / L, 1e3 * inside / calls if calls else 0.0)


def shard_timing(ecfg: RunConfig, tp: int, steps: int = 64, warmup: int = 8, timeout_s: float = 600.0,
                 lockstep: bool = False) -> dict[str, float]:
    """{"layer_ms": ms per layer of a 1/tp shard, tp shards stepping at once in tp processes
    (slowest rank), "allreduce_ms": with lockstep, the mean all-reduce between them (the slowest
    rank's; 0 without)}. lockstep: with their real all-reduces, whose time is left out of layer_ms
    (the module docstring)."""
    from spd_engine.engine.comm.dist import free_port

    ctx = mp.get_context("spawn")
    barrier, out = ctx.Barrier(tp), ctx.Manager().dict()
    port = free_port() if lockstep else None
    procs = [ctx.Process(target=_time_shard, args=(ecfg, tp, r, steps, warmup, barrier, out, port, timeout_s))
             for r in range(tp)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout_s)
    if any(p.exitcode != 0 for p in procs) or len(out) != tp:
        for p in procs:
            if p.is_alive():
                p.kill()
        raise RuntimeError(f"TP shard timing failed: exit codes {[p.exitcode for p in procs]}")
    return {"layer_ms": max(v[0] for v in out.values()), "allreduce_ms": max(v[1] for v in out.values())}


def shard_layer_ms(ecfg: RunConfig, tp: int, steps: int = 64, warmup: int = 8, timeout_s: float = 600.0,
                   lockstep: bool = False) -> float:
    """ms per layer of a 1/tp shard (shard_timing's layer_ms)."""
    return shard_timing(ecfg, tp, steps, warmup, timeout_s, lockstep)["layer_ms"]

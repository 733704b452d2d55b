"""Interconnect benchmark: the P2P, all-reduce and fan-in measurements behind `spd netbench` (the
SPD tick replay is bench/tick_replay.py), and its launch (local ranks or torchrun) on the
process-group layer of engine/comm/dist.py.

Definitions (also written into every JSON report):
- P2P latency: one-way time = half the round trip of a ping-pong with `bytes` in each
  direction, receives posted before the matching send (as a pipeline stage does); for sizes
  up to 64 KiB also "idle": both ends idle for a gap first, so each message wakes its peer,
  and "late": a receive posted a gap after its send, timed from posting to completion.
- bandwidth = bytes / p50 one-way time (GB/s = 1e9 B/s).
- all-reduce latency: per iteration, the slowest member rank's time for one blocking
  all-reduce of `bytes` (float32) over the first `ranks` ranks (a stage's TP group when the
  stage's ranks start at 0), by default the runtime's own TP all-reduce (engine/comm/tp_group.py:
  all_gather, then a sum in rank order), so the cost model's TP rows get what the runtime pays;
  `allreduce_op="library"` times torch.distributed's all_reduce instead.
- algbw and busbw as nccl-tests define them: algbw = bytes / p50 time; busbw = algbw times the
  share of the data each rank's links carry, 2 (r-1) / r for an all-reduce over r ranks (a
  ring's), 1 for P2P. busbw is comparable with the link's peak bandwidth.
- fan-in: rank 0 posts a 4-byte "go" to every other rank, each answers with a [k, H] payload
  at once; time = rank 0's time from the first go to the last payload.
- jitter = p99 - p50.
Every receive and collective waits at most `timeout_s`; a dead or stuck peer turns into an
error on every rank, never a hang. Gloo (CPU) is tested; the NCCL path is written but has
not been run on a multi-GPU machine.
"""
from __future__ import annotations

import os
import socket
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist

from spd_engine.bench.stats import bandwidth_gbps, summarize_us
from spd_engine.bench.tick_replay import ReplayConfig, run_scenarios
from spd_engine.bench.transport_p2p import transport_bench
from spd_engine.engine.comm.dist import (
    LocalRanks,
    PeerError,
    RankContext,
    RunFailed,
    check_gpus,
    fail_rank,
    finish_group,
    join_group,
    local_init_method,
    resolve_backend,
    torchrun_rank,
)
from spd_engine.engine.comm.tp_group import DistTPGroup
from spd_engine.engine.comm.transport import directional_groups

SCHEMA = "spd-netbench/1"
IDLE_MAX_BYTES = 1 << 16  # idle (cold) ping-pong for the small messages a pipeline tick sends
NCCL_NOTE = "NCCL path untested: it has not been run on a multi-GPU machine yet"
TIME_DEFINITIONS = {
    "p2p": "one-way latency = half a ping-pong round trip (bytes each way, receives pre-posted); "
           "bw_GBps = bytes / p50_us; post_us = p50 time to post one send (post_mean_us: its mean); "
           "stream_us = time per message of a back-to-back stream (1 / message rate); "
           "idle_*: the same ping-pong with both ends idle for idle_gap_ms first (every message wakes "
           "an idle peer, as in a pipeline tick); late_*: a receive posted idle_gap_ms after its send, "
           "from posting to completion (the runtime's transport receives a message's payloads so)",
    "allreduce": "per iteration, the slowest member's time for one blocking float32 all-reduce (allreduce_op "
                 "'tp': the runtime's TP all-reduce, all_gather + a sum in rank order; 'library': dist.all_reduce), "
                 "each after allreduce_busy_us of compute on every member (0: back to back)",
    "busbw": "algbw = bytes / p50_us; busbw = algbw * 2(r-1)/r for an all-reduce over r ranks, = algbw for P2P "
             "(nccl-tests)",
    "fanin": "rank 0: first go message posted -> last [k,H] payload received; bw_GBps = all payload bytes / p50_us",
    "transport": "one-way latency = half a round trip of a header + payload message through the engine's "
                 "Transport (gloo frames or shared-memory rings), less the compute before each send (the responder's "
                 "busy_us; with busy_mb both ends stream that many MiB of weights first, as a decoding rank does)",
    "jitter": "p99_us - p50_us",
}


@dataclass
class DistContext(RankContext):
    """A rank's context (engine/comm/dist.py) with the P2P groups the measurements use."""

    groups: dict = field(default_factory=dict)  # (src, dst) -> P2P group (engine/comm/transport.py directional_groups)

    @classmethod
    def join(cls, rank: int, world_size: int, backend: str, init_method: str, timeout_s: float,
             node_rank: int = 0) -> "DistContext":
        base = join_group(rank, world_size, backend, "cuda" if backend == "nccl" else "cpu", init_method, timeout_s,
                          node_rank)
        # one P2P group per direction, as the runtime's transport: NCCL would otherwise serialise a
        # ping-pong's pre-posted receive and its send to the same peer on one stream (a deadlock)
        return cls(**vars(base), groups=directional_groups(rank, world_size))

    def isend(self, buf: torch.Tensor, dst: int, what: str = "") -> dist.Work:
        """Post a send; `what` ("stage 1: send to rank 3") names it if posting fails."""
        try:
            return dist.isend(buf, dst, group=self.groups.get((self.rank, dst)))
        except RuntimeError as err:  # gloo can fail at posting once the peer's socket is gone
            raise PeerError(f"{what or f'send to rank {dst}'}: posting failed: {err}") from err

    def irecv(self, buf: torch.Tensor, src: int, what: str = "") -> dist.Work:
        try:
            return dist.irecv(buf, src, group=self.groups.get((src, self.rank)))
        except RuntimeError as err:
            raise PeerError(f"{what or f'receive from rank {src}'}: posting failed: {err}") from err


# ---------------------------------------------------------------- launching the ranks

RankFn = Callable[[DistContext, Any], Any]


def run_torchrun_rank(target: RankFn, payload: Any, backend: str, timeout_s: float) -> Any:
    """Run this process as one torchrun worker; returns rank 0's result (None elsewhere).
    On error the message is printed with the rank and the process exits non-zero."""
    me = torchrun_rank()
    try:
        ctx = DistContext.join(me.rank, me.world_size, resolve_backend(backend), "env://", timeout_s, me.node_rank)
        result = target(ctx, payload)
        finish_group(ctx)
        return result
    except Exception as err:  # report on this rank, then leave without touching the broken group
        fail_rank(me.rank, err)


def _local_rank(rank: int, world_size: int, init_method: str, backend: str, timeout_s: float,
                target: RankFn, payload: Any, nice: int) -> Any:
    torch.set_num_threads(1)  # ranks share the host's cores; one intra-op thread each
    if nice:
        os.nice(nice)  # negative: wake ahead of unrelated jobs on a shared host
    ctx = DistContext.join(rank, world_size, backend, init_method, timeout_s)
    result = target(ctx, payload)
    finish_group(ctx)
    return result if rank == 0 else None


def launch_local(target: RankFn, payload: Any, nproc: int, backend: str, timeout_s: float,
                 deadline_s: float, nice: int = 0) -> Any:
    """Start `nproc` ranks on this host, run `target(ctx, payload)` on each, return rank 0's
    result. Raises RunFailed listing every rank's exit status if any rank failed. `nice` is
    added to each rank's scheduling niceness (negative values need privileges)."""
    if nproc < 2:
        raise ValueError(f"need at least 2 ranks, got --nproc {nproc}")
    backend = resolve_backend(backend)
    if backend == "nccl":
        check_gpus("cuda", nproc)
    args = (nproc, local_init_method(), backend, timeout_s, target, payload, nice)
    with LocalRanks(_local_rank, range(nproc), args) as ranks:  # forked from one server that imported torch
        ranks.join(deadline_s)
        if ranks.failed():
            raise RunFailed(ranks.failure_report())
        return ranks.result(0)


# ---------------------------------------------------------------- measurements

@dataclass
class NetbenchConfig:
    """What to measure. Sizes in bytes; every rank receives the same config."""

    tests: tuple[str, ...] = ("p2p", "allreduce", "fanin")
    sizes: tuple[int, ...] = (4, 64, 1024, 16384, 262144, 4 << 20, 64 << 20)
    pairs: tuple[tuple[int, int], ...] | None = None  # None: (0,r) for all r and (r,r+1)
    iters: int = 100
    warmup: int = 10
    allreduce_bytes: tuple[int, ...] = (4, 8192)
    allreduce_op: str = "tp"  # "tp": the runtime's TP all-reduce (engine/comm/tp_group.py); "library": dist.all_reduce
    # each rank computes this long before every timed all-reduce, as a TP rank does between its
    # reductions (0: back to back); on a CPU a reduction after compute costs more (docs/benchmarks.md)
    allreduce_busy_us: float = 0.0
    transport_busy_us: float = 0.0  # --tests transport: the responder computes this long before it answers
    transport_busy_mb: float = 0.0  # --tests transport: both ends stream this many MiB of weights before each send
    hidden: int = 4096
    dtype_bytes: int = 2
    fanin_rows: tuple[int, ...] = (1, 4)
    replay: list[ReplayConfig] = field(default_factory=list)  # tick replay scenarios
    idle_gap_ms: float = 2.0  # idle ping-pong (sizes up to IDLE_MAX_BYTES): peers idle this long first
    timeout_s: float = 30.0
    # an emulated link latency (RunConfig.parallel.link_delay_us): added to the runtime's transport (the
    # `transport` test) and to each step of the TP all-reduce; the raw p2p, fan-in and library
    # all-reduce rows are the link as it is (a tc-shaped link's bandwidth shows there)
    link_delay_us: float = 0.0


def default_pairs(world_size: int) -> list[tuple[int, int]]:
    """Driver <-> every stage, then neighbouring stages: the links SPD uses."""
    pairs = [(0, r) for r in range(1, world_size)]
    pairs += [(r, r + 1) for r in range(1, world_size - 1)]
    return pairs


def iters_for(cfg: NetbenchConfig, nbytes: int) -> tuple[int, int]:
    """(warmup, timed) iterations: fewer for messages above 1 MiB so a size takes bounded time.
    Deterministic, so both ends of a pair agree without negotiating."""
    scale = min(1.0, (1 << 20) / nbytes)
    return max(1, int(cfg.warmup * scale)), max(5, int(cfg.iters * scale))


def _pingpong(ctx: DistContext, peer: int, nbytes: int, warmup: int, iters: int, initiator: bool,
              gap_s: float = 0.0):
    """Round trips (and the initiator's send-post times), receives pre-posted on both ends. With
    gap_s > 0 the initiator idles before each round trip, so every message wakes an idle peer."""
    send = torch.zeros(nbytes, dtype=torch.uint8, device=ctx.device)
    recv = torch.empty(nbytes, dtype=torch.uint8, device=ctx.device)
    what = f"p2p {nbytes}B with rank {peer}"
    rtts, posts = [], []
    if initiator:
        for i in range(warmup + iters):
            if gap_s:
                time.sleep(gap_s)
            ctx.sync()
            t0 = time.perf_counter()
            r = ctx.irecv(recv, peer)
            s = ctx.isend(send, peer)
            t1 = time.perf_counter()
            ctx.wait(r, what)
            ctx.sync()
            t2 = time.perf_counter()
            ctx.wait(s, what)
            if i >= warmup:
                rtts.append(t2 - t0)
                posts.append(t1 - t0)
        return rtts, posts
    r = ctx.irecv(recv, peer)
    for i in range(warmup + iters):
        ctx.wait(r, what)
        s = ctx.isend(send, peer)
        if i + 1 < warmup + iters:
            r = ctx.irecv(recv, peer)  # pre-post the next receive before waiting on the send
        ctx.wait(s, what)
    return None


def _stream(ctx: DistContext, peer: int, nbytes: int, iters: int, receiver: bool, window: int = 8):
    """Back-to-back messages peer -> receiver, `window` sends in flight. The receiver returns the
    time per message at saturation (1 / message rate): a host's cost to take in one message."""
    what = f"p2p stream {nbytes}B with rank {peer}"
    count = max(iters, 3)
    if receiver:
        bufs = [torch.empty(nbytes, dtype=torch.uint8, device=ctx.device) for _ in range(2)]
        r = ctx.irecv(bufs[0], peer)
        stamps = []
        for i in range(count):
            ctx.wait(r, what)
            if i + 1 < count:
                r = ctx.irecv(bufs[(i + 1) % 2], peer)
            ctx.sync()
            stamps.append(time.perf_counter())
        return (stamps[-1] - stamps[0]) / (count - 1)
    payload = torch.zeros(nbytes, dtype=torch.uint8, device=ctx.device)
    inflight = deque()
    for _ in range(count):
        inflight.append(ctx.isend(payload, peer))
        if len(inflight) > window:
            ctx.wait(inflight.popleft(), what)
    while inflight:
        ctx.wait(inflight.popleft(), what)
    return None


def p2p_bench(ctx: DistContext, cfg: NetbenchConfig) -> list[dict]:
    rows = []
    pairs = cfg.pairs if cfg.pairs is not None else default_pairs(ctx.world_size)
    for a, b in pairs:
        for nbytes in cfg.sizes:
            warmup, iters = iters_for(cfg, nbytes)
            if ctx.rank in (a, b):
                peer = b if ctx.rank == a else a
                res = _pingpong(ctx, peer, nbytes, warmup, iters, ctx.rank == a)
                idle = late = None
                if cfg.idle_gap_ms > 0 and nbytes <= IDLE_MAX_BYTES:
                    idle = _pingpong(ctx, peer, nbytes, 2, iters, ctx.rank == a, cfg.idle_gap_ms / 1e3)
                    late = _late_receive(ctx, peer, nbytes, iters, ctx.rank == a, cfg.idle_gap_ms / 1e3)
                stream = _stream(ctx, peer, nbytes, iters, ctx.rank == a)
                if res is not None:
                    rows.append(_p2p_row(a, b, nbytes, res, idle, stream, late))
            ctx.barrier(f"barrier after p2p {a}-{b} {nbytes}B")
    return rows


def _late_receive(ctx: DistContext, peer: int, nbytes: int, iters: int, receiver: bool, gap_s: float):
    """Receives posted `gap_s` after the peer posted its send, as the runtime's transport does
    for every tensor of a message but the first (and for a message that came while its receiver
    was busy). The receiver returns each receive's time from posting to completion: what a
    rendezvous protocol (gloo's: the data moves once the receive is posted) costs it."""
    what = f"p2p late receive {nbytes}B with rank {peer}"
    ack = torch.zeros(4, dtype=torch.uint8, device=ctx.device)
    if receiver:
        buf, times = torch.empty(nbytes, dtype=torch.uint8, device=ctx.device), []
        for _ in range(iters):
            time.sleep(gap_s)  # the peer's send is posted by now
            ctx.sync()
            t0 = time.perf_counter()
            ctx.wait(ctx.irecv(buf, peer), what)
            ctx.sync()
            times.append(time.perf_counter() - t0)
            ctx.wait(ctx.isend(ack, peer), what)  # the next send may go
        return times
    payload = torch.zeros(nbytes, dtype=torch.uint8, device=ctx.device)
    for _ in range(iters):
        ctx.wait(ctx.isend(payload, peer), what)
        ctx.wait(ctx.irecv(ack, peer), what)
    return None


def _p2p_row(a: int, b: int, nbytes: int, hot, idle, stream: float, late: list[float] | None = None) -> dict:
    rtts, posts = hot
    row = {"src": a, "dst": b, "bytes": nbytes, **summarize_us([t / 2 for t in rtts])}
    row["bw_GBps"] = bandwidth_gbps(nbytes, row["p50_us"])
    row.update(bus_bandwidth(row["bw_GBps"], ranks=2, allreduce=False))
    post = summarize_us(posts)
    row["post_us"], row["post_mean_us"] = post["p50_us"], post["mean_us"]  # sender busy time
    if idle is not None:
        one_way, idle_post = summarize_us([t / 2 for t in idle[0]]), summarize_us(idle[1])
        row.update(idle_p50_us=one_way["p50_us"], idle_mean_us=one_way["mean_us"], idle_p99_us=one_way["p99_us"],
                   idle_post_mean_us=idle_post["mean_us"])
    if late is not None:
        late_stats = summarize_us(late)
        row.update(late_p50_us=late_stats["p50_us"], late_mean_us=late_stats["mean_us"])
    row["stream_us"] = stream * 1e6
    return row


def allreduce_group_sizes(world_size: int) -> list[int]:
    sizes, g = [], 2
    while g < world_size:
        sizes.append(g)
        g *= 2
    return sizes + [world_size]


def allreduce_bench(ctx: DistContext, cfg: NetbenchConfig) -> list[dict]:
    """Per-iteration times on this rank, keyed for rank 0 to take the max over members."""
    out = []
    for g in allreduce_group_sizes(ctx.world_size):
        group = dist.new_group(list(range(g))) if g < ctx.world_size else None
        tp = DistTPGroup(group, range(g), ctx.rank, ctx.timeout_s) if ctx.rank < g else None
        if tp is not None:
            tp.link_delay_ns = round(cfg.link_delay_us * 1e3)
        for nbytes in cfg.allreduce_bytes:
            warmup, iters = iters_for(cfg, nbytes)
            if ctx.rank < g:
                buf = torch.ones(max(1, nbytes // 4), dtype=torch.float32, device=ctx.device)
                busy = torch.ones(64, 64, device=ctx.device)  # [64, 64] the compute between reductions
                times = []
                for i in range(warmup + iters):
                    _compute_for(busy, cfg.allreduce_busy_us)
                    ctx.sync()
                    t0 = time.perf_counter()
                    if cfg.allreduce_op == "tp":
                        tp.all_reduce(buf)
                    else:
                        ctx.wait(dist.all_reduce(buf, group=group, async_op=True), f"all-reduce {nbytes}B over {g} ranks")
                    ctx.sync()
                    if i >= warmup:
                        times.append(time.perf_counter() - t0)
                out.append({"ranks": g, "bytes": nbytes, "times": times})
            ctx.barrier(f"barrier after all-reduce over {g} ranks")
    return out


def _compute_for(x: torch.Tensor, us: float) -> None:
    """Small matmuls on x's device until `us` microseconds have passed (host clock)."""
    if us <= 0:
        return
    end = time.perf_counter() + us / 1e6
    while time.perf_counter() < end:
        x = (x @ x).clamp_(-1.0, 1.0)


def fanin_bench(ctx: DistContext, cfg: NetbenchConfig) -> list[dict]:
    rows = []
    senders = list(range(1, ctx.world_size))
    for k in cfg.fanin_rows:
        nbytes = k * cfg.hidden * cfg.dtype_bytes
        warmup, iters = iters_for(cfg, nbytes)
        go = torch.zeros(4, dtype=torch.uint8, device=ctx.device)
        what = f"fan-in [{k},{cfg.hidden}]"
        if ctx.rank == 0:
            bufs = [torch.empty(nbytes, dtype=torch.uint8, device=ctx.device) for _ in senders]
            times = []
            for i in range(warmup + iters):
                ctx.sync()
                t0 = time.perf_counter()
                recvs = [ctx.irecv(buf, s) for buf, s in zip(bufs, senders)]
                sends = [ctx.isend(go, s) for s in senders]
                for w in recvs:
                    ctx.wait(w, what)
                ctx.sync()
                if i >= warmup:
                    times.append(time.perf_counter() - t0)
                for w in sends:
                    ctx.wait(w, what)
            row = {"senders": len(senders), "rows": k, "hidden": cfg.hidden, "bytes": nbytes, **summarize_us(times)}
            row["bw_GBps"] = bandwidth_gbps(nbytes * len(senders), row["p50_us"])
            rows.append(row)
        else:
            payload = torch.zeros(nbytes, dtype=torch.uint8, device=ctx.device)
            for _ in range(warmup + iters):
                ctx.wait(ctx.irecv(go, 0), what)
                ctx.wait(ctx.isend(payload, 0), what)
        ctx.barrier(f"barrier after {what}")
    return rows


def netbench_rank(ctx: DistContext, cfg: NetbenchConfig) -> dict | None:
    """Everything one rank does for `spd netbench`; rank 0 returns the assembled report."""
    local: dict[str, Any] = {"rank": ctx.rank, "host": socket.gethostname(), "node_rank": ctx.node_rank}
    ctx.barrier("start barrier")
    if "p2p" in cfg.tests:
        local["p2p"] = p2p_bench(ctx, cfg)
    if "transport" in cfg.tests:
        pairs = cfg.pairs if cfg.pairs is not None else default_pairs(ctx.world_size)
        sizes = [b for b in cfg.sizes if b <= IDLE_MAX_BYTES]  # a decode tick's message sizes
        local["transport"] = transport_bench(ctx, list(pairs), sizes, cfg.iters, cfg.transport_busy_us,
                                             cfg.transport_busy_mb, cfg.link_delay_us)
    if "allreduce" in cfg.tests:
        local["allreduce"] = allreduce_bench(ctx, cfg)
    if "fanin" in cfg.tests and ctx.world_size > 1:
        local["fanin"] = fanin_bench(ctx, cfg)
    if "replay" in cfg.tests:
        replay = run_scenarios(ctx, cfg.replay)  # the driver's results, with every stage's STATS
        if replay is not None:
            local["replay"] = replay
    gathered = [None] * ctx.world_size if ctx.rank == 0 else None
    try:
        dist.gather_object(local, gathered, dst=0)
    except Exception as err:  # gather uses the group timeout; name it like our own waits
        raise PeerError(f"gathering results on rank 0 failed: {err}") from err
    return assemble_report(ctx, cfg, gathered) if ctx.rank == 0 else None


def assemble_report(ctx: DistContext, cfg: NetbenchConfig, per_rank: list[dict]) -> dict:
    report: dict[str, Any] = {
        "schema": SCHEMA,
        "backend": ctx.backend,
        "device": ctx.device.type,
        "world_size": ctx.world_size,
        "link_delay_us": cfg.link_delay_us,
        "ranks": [{k: r[k] for k in ("rank", "host", "node_rank")} for r in per_rank],
        "nccl_tested": False,
        "note": NCCL_NOTE if ctx.backend == "nccl" else "gloo backend (CPU)",
        "definitions": TIME_DEFINITIONS,
        "config": {k: v for k, v in asdict(cfg).items() if k != "replay"},
        "p2p": [row for r in per_rank for row in r.get("p2p", [])],
        "fanin": [row for r in per_rank for row in r.get("fanin", [])],
        "transport": [row for r in per_rank for row in r.get("transport", [])],
    }
    if any("allreduce" in r for r in per_rank):
        report["allreduce"] = _merge_allreduce(per_rank)
    if "replay" in per_rank[0]:
        report["tick_replay"] = per_rank[0]["replay"]
    return report


def _merge_allreduce(per_rank: list[dict]) -> list[dict]:
    by_key: dict[tuple[int, int], list[list[float]]] = {}
    for r in per_rank:
        for entry in r.get("allreduce", []):
            by_key.setdefault((entry["ranks"], entry["bytes"]), []).append(entry["times"])
    rows = []
    for (g, nbytes), lists in sorted(by_key.items()):
        assert len(lists) == g, "every member of the group reports its times"
        slowest = [max(ts) for ts in zip(*lists)]
        row = {"ranks": g, "bytes": nbytes, **summarize_us(slowest)}
        row.update(bus_bandwidth(bandwidth_gbps(nbytes, row["p50_us"]), ranks=g, allreduce=True))
        rows.append(row)
    return rows


def bus_bandwidth(algbw_gbps: float, ranks: int, allreduce: bool) -> dict[str, float]:
    """nccl-tests' algbw and busbw (GB/s): an all-reduce over r ranks moves 2 (r-1)/r of the
    data over each rank's links (reduce-scatter, then all-gather), a P2P message all of it once."""
    factor = 2 * (ranks - 1) / ranks if allreduce else 1.0
    return {"algbw_GBps": algbw_gbps, "busbw_GBps": algbw_gbps * factor}

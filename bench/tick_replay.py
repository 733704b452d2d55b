"""SPD tick replay: the runtime's per-tick message pattern (docs/design.md 3.3) with synthetic
(sleeping) compute, on the engine's own wire code: its transport (engine/comm/transport.py
DistTransport), header and wire format (engine/protocol/messages.py), rank map (engine/protocol/topology.py)
and tick protocol (engine/protocol/tick.py TickState).

Stage ranks sleep their configured compute time per token, then send their output downstream
and their anchor states to the driver (the last stage sends its anchors and its exit), each a
header followed by the payloads the wire format gives. The driver, per tick as TickState
plans it: sends the entering token to stage 0, waits for exactly the anchor messages the PDM
rows need, sleeps the PDM time, and when a token leaves the last stage receives its exit,
"verifies" it (sleeps the verify time, accepts with probability alpha from a seeded RNG) and
advances the state. A rejection bumps the epoch; stale messages keep flowing and are dropped
by epoch (docs/design.md 3.4), so the pipeline refills for n-1 ticks without verification.
A scenario ends as a request does: END down the pipe, the driver drains every stage's link,
and each stage replies with its STATS (measured compute, input wait, send posting).

Sleeping stages use no CPU, so the pattern replays faithfully on a few shared cores. Layout:
driver rank 0 and stage p on rank p+1, or co-located (stage 0 on rank 0, stage p on rank p).
"""
from __future__ import annotations

import os
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from spd_engine.costmodel.cost_inputs import message_bytes
from spd_engine.engine.comm.dist import PeerError, RankContext
from spd_engine.engine.comm.transport import DistTransport, TransportError
from spd_engine.engine.protocol.messages import Header, Kind, Payload, WireFormat, link_frames
from spd_engine.engine.protocol.schedule import decode_ticks, eal, expected_eal
from spd_engine.engine.protocol.tick import Draft, TickPlan, TickState, Verdict
from spd_engine.engine.protocol.topology import Topology
from spd_engine.engine.runtime.stage_links import StageLinks

_DRAFT, _CORRECTION = 1, 2  # token ids that stand for a draft and a correction
_DTYPES = {1: torch.uint8, 2: torch.float16, 4: torch.float32, 8: torch.float64}  # synthetic activations
_STATS = ("tokens", "compute_s", "wait_s", "post_s")  # a stage's STATS payload, float64


@dataclass(frozen=True)
class ReplayConfig:
    """One replay scenario; `n = len(stage_ms)`."""

    stage_ms: tuple[float, ...]
    pdm_ms: float = 0.5
    verify_ms: float = 0.2
    alpha: float = 0.8
    tokens: int = 64  # N generated tokens, the first from the prefill
    seed: int = 0
    hidden: int = 4096
    dtype_bytes: int = 2
    anchors: int = 1  # anchor rows k each stage sends the driver per token
    colocate: bool = False
    fault_rank: int | None = None  # fault injection: this rank fails at tick `fault_tick`,
    fault_tick: int = 0  # by exiting ("exit") or by going silent for 3 timeouts ("stall")
    fault: str = "exit"

    @property
    def n(self) -> int:
        return len(self.stage_ms)

    @property
    def topology(self) -> Topology:
        """The rank map (layers do not matter here: one per stage)."""
        return Topology((1,) * self.n, self.colocate)

    @property
    def wire(self) -> WireFormat:
        return WireFormat(self.hidden, (self.anchors,) * self.n)

    def ranks_needed(self) -> int:
        return self.topology.world_size

    def stage_rank(self, p: int) -> int:
        return self.topology.stage_rank(p)

    def validate(self, world_size: int) -> None:
        if self.n < 2:
            raise ValueError(f"tick replay needs at least 2 stages, got {list(self.stage_ms)}")
        if any(c < 0 for c in self.stage_ms) or self.pdm_ms < 0 or self.verify_ms < 0:
            raise ValueError("tick replay: compute times must be >= 0 ms")
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"alpha must be in [0, 1], got {self.alpha}")
        if self.tokens < 2:
            raise ValueError(f"tick replay needs at least 2 tokens, got {self.tokens}")
        if self.anchors < 1 or self.hidden < 1 or self.dtype_bytes not in _DTYPES:
            raise ValueError(f"tick replay needs anchors >= 1, hidden >= 1 and dtype bytes in {sorted(_DTYPES)}")
        if self.fault not in ("exit", "stall"):
            raise ValueError(f"fault must be exit or stall, got {self.fault!r}")
        if self.ranks_needed() > world_size:
            layout = "co-located" if self.colocate else "separate driver"
            raise ValueError(f"{self.n} stages with a {layout} need {self.ranks_needed()} ranks, "
                             f"the run has {world_size}")

    def message_bytes(self) -> dict[str, int]:
        """Wire sizes: token to stage 0, activation between stages, anchors, last stage's exit."""
        return message_bytes(self.hidden, self.dtype_bytes, self.anchors)


def _maybe_fail(ctx: RankContext, sc: ReplayConfig, tick: int) -> None:
    if sc.fault_rank != ctx.rank or tick != sc.fault_tick:
        return
    print(f"rank {ctx.rank}: injected fault: {sc.fault} at tick {tick}", file=sys.stderr, flush=True)
    if sc.fault == "exit":
        os._exit(17)
    time.sleep(3 * ctx.timeout_s)  # silent but alive: peers must give up on their own timeouts
    raise PeerError(f"injected stall at tick {tick} ended")


Follows = Callable[[Header], Sequence[Payload]]  # what follows a header on one link (a WireFormat method)


class _Wire:
    """This rank's end of the engine's transport: synthetic payloads (zeros, preallocated by
    shape; received ones land in buffers of their own) and errors naming role and operation."""

    def __init__(self, ctx: RankContext, transport: DistTransport, sc: ReplayConfig) -> None:
        self.t, self.timeout, self.dtype, self.device = transport, ctx.timeout_s, _DTYPES[sc.dtype_bytes], ctx.device
        self._out: dict[tuple, torch.Tensor] = {}
        self._in: dict[tuple, torch.Tensor] = {}

    def _buffer(self, pool: dict, p: Payload) -> torch.Tensor:
        key = (p.shape, p.kind)
        if key not in pool:
            dtype = {"int64": torch.int64, "float64": torch.float64}.get(p.kind, self.dtype)
            pool[key] = torch.zeros(p.shape, dtype=dtype, device=self.device)
        return pool[key]

    def send(self, dst: int, hdr: Header, payloads: Sequence[Payload], what: str,
             tensors: Sequence[torch.Tensor] = ()) -> None:
        """The header, then `tensors` if given, else synthetic zeros of the `payloads` shapes."""
        try:
            self.t.send(dst, hdr, list(tensors) or [self._buffer(self._out, p) for p in payloads])
        except TransportError as err:
            raise PeerError(f"{what} failed: {err}") from err

    def recv(self, src: int, follows: Follows, what: str, tick: int) -> tuple[Header, list[torch.Tensor]]:
        """The next header from src and the payloads that follow it."""
        try:
            hdr = self.t.recv_header(src, self.timeout, tick)
            return hdr, [self.t.recv_into(src, self._buffer(self._in, p), self.timeout, tick) for p in follows(hdr)]
        except TransportError as err:
            raise PeerError(f"{what} failed: {err}") from err

    def flush(self, what: str) -> None:
        try:
            self.t.flush()
        except RuntimeError as err:
            raise PeerError(f"{what}: waiting for sends failed: {err}") from err


def _stage_loop(ctx: RankContext, io: _Wire, sc: ReplayConfig, p: int) -> None:
    """Stage p until END, then its STATS to the driver."""
    topo, wire, driver = sc.topology, sc.wire, sc.topology.driver_rank
    src = driver if p == 0 else topo.stage_rank(p - 1)
    dst = topo.stage_rank(p + 1) if p + 1 < sc.n else None
    incoming: Follows = wire.from_driver if p == 0 else wire.downstream
    what = f"stage {p}: receive from rank {src}"
    count, compute, waited, posting = 0, 0.0, 0.0, 0.0
    while True:
        t_wait = time.perf_counter()
        hdr, _ = io.recv(src, incoming, what, count + 1 + p)  # message k entered stage 0 at tick k
        if hdr.kind == Kind.END:
            break
        if count > 0:  # the wait for the first token is pipeline fill, not steady-state waiting
            waited += time.perf_counter() - t_wait
        t0 = time.perf_counter()
        time.sleep(sc.stage_ms[p] / 1e3)
        t1 = time.perf_counter()
        compute += t1 - t0
        if dst is not None:  # downstream first: it is on the critical path
            io.send(dst, hdr, wire.downstream(hdr), f"stage {p}: send to rank {dst}")
        io.send(driver, hdr, wire.to_driver(p, hdr), f"stage {p}: send to rank {driver}")
        posting += time.perf_counter() - t1
        count += 1
        _maybe_fail(ctx, sc, count + p)
    if dst is not None:
        io.send(dst, hdr, (), f"stage {p}: send to rank {dst}")
    stats = torch.tensor([count, compute, waited, posting], dtype=torch.float64)
    io.send(driver, Header(Kind.STATS, length=len(_STATS)), (), f"stage {p}: send to rank {driver}", [stats])
    io.flush(f"stage {p}")


class _Driver:
    """Rank 0's side of the replay: the tick protocol, synthetic PDM and verification, the
    message bookkeeping of the end-of-request drain, and its own timers."""

    def __init__(self, ctx: RankContext, io: _Wire, sc: ReplayConfig) -> None:
        self.ctx, self.io, self.sc, self.n = ctx, io, sc, sc.n
        self.topo, self.wire = sc.topology, sc.wire
        self.first = 1 if sc.colocate else 0  # co-located: stage 0 runs here, its anchors are local
        self.rng = random.Random(sc.seed)
        self.state = TickState(sc.n, 0, _DRAFT, anchor_stages=range(self.first, sc.n - 1))
        # the runtime's receive and drain code (engine/runtime/stage_links.py); a co-located stage 0's
        # anchors are local, so its link carries nothing
        self.links = StageLinks(io.t, [self.topo.stage_rank(s) for s in range(sc.n)],
                                [s >= self.first and self.wire.reports_to_driver(s) for s in range(sc.n)],
                                ctx.timeout_s, self._payloads)
        self.stage0: list[float] = []
        self.busy = {"wait_anchors": 0.0, "pdm": 0.0, "wait_exit": 0.0, "verify": 0.0}  # seconds, summed

    def enter(self, plan: TickPlan) -> None:
        """The entering token to stage 0; co-located, stage 0 runs here first and its output leaves."""
        (entry,) = plan.enter
        hdr = Header(Kind.TOKEN, entry.pos, entry.epoch, entry.token)
        if self.sc.colocate:
            t0 = time.perf_counter()
            time.sleep(self.sc.stage_ms[0] / 1e3)
            self.stage0.append(time.perf_counter() - t0)
            dst, payloads = self.topo.stage_rank(1), self.wire.downstream(hdr)
        else:
            dst, payloads = self.topo.stage_rank(0), self.wire.from_driver(hdr)
        self.io.send(dst, hdr, payloads, f"driver: send to rank {dst}")
        self.links.sent += 1

    def _payloads(self, s: int, hdr: Header, _where: object) -> None:
        """What follows stage s's header, into synthetic buffers."""
        for p in self.wire.to_driver(s, hdr):
            self.io.t.recv_into(self.topo.stage_rank(s), self.io._buffer(self.io._in, p), self.io.timeout,
                                self.state.tick)

    def read(self, s: int, pos: int, epoch: int, tick: int) -> None:
        """Stage s's messages up to the current-epoch one for `pos`; stale ones are dropped."""
        try:
            self.links.find(s, Kind.TOKEN, pos, epoch, tick)
        except TransportError as err:
            raise PeerError(f"driver: receive from stage {s} (rank {self.topo.stage_rank(s)}) failed: {err}") from err

    def tick(self, plan: TickPlan) -> Verdict | None:
        t0 = time.perf_counter()
        for s, e in plan.anchor_reads:  # the anchors of tick-1 that this tick's PDM rows need
            self.read(s, e.pos, e.epoch, plan.tick)
        t1 = time.perf_counter()
        time.sleep(self.sc.pdm_ms / 1e3)
        t2 = time.perf_counter()
        self.busy["wait_anchors"] += t1 - t0
        self.busy["pdm"] += t2 - t1
        if plan.exit is None:
            return None  # pipeline fill or refill: nothing to verify this tick
        self.read(self.n - 1, plan.exit.pos, plan.exit.epoch, plan.tick)
        t3 = time.perf_counter()
        time.sleep(self.sc.verify_ms / 1e3)
        self.busy["wait_exit"] += t3 - t2
        self.busy["verify"] += time.perf_counter() - t3
        accepted = self.rng.random() < self.sc.alpha
        proposed = plan.proposed.token if plan.proposed is not None else _DRAFT
        return Verdict(accepted, proposed if accepted else _CORRECTION)

    def close(self) -> list[dict]:
        """END down the pipe, drain every stage's link, collect the stages' STATS."""
        dst = self.topo.stage_rank(self.first)
        self.io.send(dst, Header(Kind.END), (), f"driver: send to rank {dst}")
        stats = []
        for s in range(self.first, self.n):
            try:
                self.links.drain(self.state.tick, [s])
            except TransportError as err:
                raise PeerError(f"driver: draining stage {s} failed: {err}") from err
            rank = self.topo.stage_rank(s)
            hdr, (values,) = self.io.recv(rank, lambda h: self.wire.to_driver(s, h),
                                          f"driver: receive stats from stage {s} (rank {rank})", self.state.tick)
            assert hdr.kind == Kind.STATS and hdr.length == len(_STATS), hdr
            stats.append(dict(zip(_STATS, values.tolist())))
        self.io.flush("driver")
        return stats


def _driver_loop(ctx: RankContext, io: _Wire, sc: ReplayConfig) -> dict:
    drv = _Driver(ctx, io, sc)
    ctx.barrier("replay start barrier")
    t_start = time.perf_counter()
    while drv.state.committed < sc.tokens:
        plan = drv.state.plan()
        _maybe_fail(ctx, sc, plan.tick)
        drv.enter(plan)
        drv.state.advance([Draft(plan.draft_pos, _DRAFT)], drv.tick(plan))
    wall = time.perf_counter() - t_start
    return _driver_result(drv, wall, drv.close())


def _driver_result(drv: _Driver, wall_s: float, stage_stats: list[dict]) -> dict:
    sc, n, counts = drv.sc, drv.n, drv.state.finish()
    ticks = counts.ticks
    assert ticks == decode_ticks(sc.tokens, n, counts.rejections), "tick count disagrees with docs/design.md 3.3"
    tick_ms = 1e3 * wall_s / ticks
    slowest = max(sc.stage_ms)
    per_token = [1e3 / max(1.0, st["tokens"]) for st in stage_stats]  # seconds summed over tokens -> ms per token
    stages = [None] * drv.first + stage_stats
    scale = [None] * drv.first + per_token
    measured = [None if st is None else st["compute_s"] * k for st, k in zip(stages, scale)]
    if drv.stage0:
        measured[0] = 1e3 * sum(drv.stage0) / len(drv.stage0)
    return {
        "n": n, "colocate": sc.colocate, "stage_ms": list(sc.stage_ms), "pdm_ms": sc.pdm_ms,
        "verify_ms": sc.verify_ms, "alpha": sc.alpha, "seed": sc.seed, "hidden": sc.hidden,
        "dtype_bytes": sc.dtype_bytes, "anchors": sc.anchors, "message_bytes": sc.message_bytes(),
        "tokens": sc.tokens, "ticks": ticks, "rejections": counts.rejections,
        "alpha_measured": counts.accepted / counts.verified,
        "eal": eal(n, sc.tokens - 1, ticks),
        "eal_formula": expected_eal(n, sc.alpha),
        "wall_ms": 1e3 * wall_s,
        "tick_ms": tick_ms,
        "decode_tok_s": (sc.tokens - 1) / wall_s,
        "pure_compute_ms": slowest,
        "overhead_ms": tick_ms - slowest,
        "overhead_pct": 100.0 * (tick_ms - slowest) / slowest if slowest > 0 else float("nan"),
        "driver_ms_per_tick": {k: 1e3 * v / ticks for k, v in drv.busy.items()},
        "pdm_ms_measured": 1e3 * drv.busy["pdm"] / ticks,
        "verify_ms_measured": 1e3 * drv.busy["verify"] / counts.verified,
        "stage_compute_ms_measured": measured,
        "stage_wait_input_ms": [None if st is None else st["wait_s"] * k for st, k in zip(stages, scale)],
        "stage_post_ms": [None if st is None else st["post_s"] * k for st, k in zip(stages, scale)],
    }


def run_scenario(ctx: RankContext, io: _Wire, sc: ReplayConfig) -> dict | None:
    """Run one scenario on this rank: the driver returns the result, every other rank None."""
    sc.validate(ctx.world_size)
    io.t.set_frames(link_frames(sc.topology, sc.wire, sc.dtype_bytes))  # the runtime's frames for this layout
    stage = sc.topology.stage_of_rank(ctx.rank)
    result = None
    if ctx.rank == sc.topology.driver_rank:
        result = _driver_loop(ctx, io, sc)
    else:
        ctx.barrier("replay start barrier")
        if stage is not None:  # spare ranks idle
            _stage_loop(ctx, io, sc, stage)
    ctx.barrier("replay end barrier")
    return result


def run_scenarios(ctx: RankContext, scenarios: Sequence[ReplayConfig]) -> list[dict] | None:
    """Every scenario in turn over one transport (its construction is collective: every rank
    builds it); rank 0's results, None elsewhere."""
    if not scenarios:
        return [] if ctx.rank == 0 else None
    transport = DistTransport(ctx.rank, ctx.world_size, ctx.device)
    results = []
    for sc in scenarios:
        results.append(run_scenario(ctx, _Wire(ctx, transport, sc), sc))
    return results if ctx.rank == 0 else None


# Scenarios behind `spd plan --validate`: n = 2, 4, 8; several alpha; even and uneven stages;
# critical paths through a stage, the driver and the verify loop; one co-located layout each.
# Stages of 4-16 ms put this host's per-message costs (0.05-0.5 ms on a busy shared CPU) at the
# few-percent share of a tick that hops have next to GPU stages.
VALIDATION_SCENARIOS = (
    ReplayConfig(stage_ms=(12.0, 12.0), pdm_ms=2.0, verify_ms=1.0, alpha=1.0, tokens=40),
    ReplayConfig(stage_ms=(16.0, 8.0), pdm_ms=2.0, verify_ms=1.0, alpha=0.7, tokens=40, seed=1),
    ReplayConfig(stage_ms=(6.0, 6.0), pdm_ms=1.0, verify_ms=4.0, alpha=0.9, tokens=40, seed=2),
    ReplayConfig(stage_ms=(8.0, 10.0), pdm_ms=2.0, verify_ms=1.0, alpha=0.8, tokens=40, seed=3, colocate=True),
    ReplayConfig(stage_ms=(10.0, 10.0, 10.0, 10.0), pdm_ms=2.0, verify_ms=1.0, alpha=0.9, tokens=40, seed=4),
    ReplayConfig(stage_ms=(6.0, 14.0, 10.0, 8.0), pdm_ms=2.0, verify_ms=1.0, alpha=0.6, tokens=40, seed=5),
    ReplayConfig(stage_ms=(4.0, 4.0, 4.0, 4.0), pdm_ms=6.0, verify_ms=2.0, alpha=0.8, tokens=40, seed=6),
    ReplayConfig(stage_ms=(4.0, 12.0, 12.0, 12.0), pdm_ms=4.0, verify_ms=2.0, alpha=0.8, tokens=40, seed=7,
                 colocate=True),
    ReplayConfig(stage_ms=(8.0,) * 8, pdm_ms=2.0, verify_ms=1.0, alpha=0.9, tokens=40, seed=8),
    ReplayConfig(stage_ms=(6.0, 10.0, 8.0, 12.0, 8.0, 6.0, 10.0, 8.0), pdm_ms=2.0, verify_ms=1.0, alpha=0.5,
                 tokens=30, seed=9),
    ReplayConfig(stage_ms=(6.0,) * 8, pdm_ms=4.0, verify_ms=4.0, alpha=0.8, tokens=40, seed=10),
)


def validation_message_sizes() -> tuple[int, ...]:
    """The wire sizes the validation replays use, so netbench measures exactly those."""
    sizes = set()
    for sc in VALIDATION_SCENARIOS:
        sizes.update(sc.message_bytes().values())
    return tuple(sorted(sizes))

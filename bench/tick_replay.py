"""SPD tick replay: the per-tick message pattern of docs/design.md 3.3 with synthetic (sleeping) compute.

Stage ranks sleep their configured compute time per tick, then send their output [1, H]
downstream and their anchor states [k, H] to the driver (the last stage sends its exit and
its anchors to the driver as one message). The driver, per tick: waits for exactly the anchors
its PDM rows need (those of current-epoch tokens from the previous tick), sleeps the PDM time,
receives the exit of the oldest token if it is current, "verifies" it (sleeps the verify time,
accepts with probability alpha from a seeded RNG), and sends the next token to stage 0. A
rejection bumps the epoch; stale tokens keep flowing and are ignored (docs/design.md 3.4), so the
pipeline refills for n-1 ticks without verification. Every message carries an int64 header
(kind, position, epoch, token, send time) ahead of the payload bytes, as one buffer; the send
time (one host, one monotonic clock) gives each stage its measured input hop latency.

Sleeping stages use no CPU, so the pattern replays faithfully on a few shared cores. Layout:
driver rank 0 and stage p on rank p+1, or co-located (stage 0 on rank 0, stage p on rank p).
"""
from __future__ import annotations

import os
import random
import sys
import time
from collections import deque
from dataclasses import dataclass

import torch

from spd_engine.bench.cost_inputs import HEADER_BYTES, message_bytes
from spd_engine.bench.netbench import DistContext, PeerError

KIND_TOKEN, KIND_END = 0, 3  # header kinds used here (docs/design.md 3.4: token, prefill, end, shutdown)


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
    anchors: int = 1  # anchor rows k per stage message
    colocate: bool = False
    fault_rank: int | None = None  # fault injection: this rank fails at tick `fault_tick`,
    fault_tick: int = 0  # by exiting ("exit") or by going silent for 3 timeouts ("stall")
    fault: str = "exit"

    @property
    def n(self) -> int:
        return len(self.stage_ms)

    def ranks_needed(self) -> int:
        return self.n if self.colocate else self.n + 1

    def stage_rank(self, p: int) -> int:
        return p if self.colocate else p + 1

    def validate(self, world_size: int) -> None:
        if self.n < 2:
            raise ValueError(f"tick replay needs at least 2 stages, got {list(self.stage_ms)}")
        if any(c < 0 for c in self.stage_ms) or self.pdm_ms < 0 or self.verify_ms < 0:
            raise ValueError("tick replay: compute times must be >= 0 ms")
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"alpha must be in [0, 1], got {self.alpha}")
        if self.tokens < 2:
            raise ValueError(f"tick replay needs at least 2 tokens, got {self.tokens}")
        if self.fault not in ("exit", "stall"):
            raise ValueError(f"fault must be exit or stall, got {self.fault!r}")
        if self.ranks_needed() > world_size:
            layout = "co-located" if self.colocate else "separate driver"
            raise ValueError(f"{self.n} stages with a {layout} need {self.ranks_needed()} ranks, "
                             f"the run has {world_size}")

    def message_bytes(self) -> dict[str, int]:
        """Wire sizes: token to stage 0, activation between stages, anchors, last stage's exit."""
        return message_bytes(self.hidden, self.dtype_bytes, self.anchors)


def _header(buf: torch.Tensor) -> list[int]:
    return buf[:HEADER_BYTES].view(torch.int64).tolist()


def _maybe_fail(ctx: DistContext, sc: ReplayConfig, tick: int) -> None:
    if sc.fault_rank != ctx.rank or tick != sc.fault_tick:
        return
    print(f"rank {ctx.rank}: injected fault: {sc.fault} at tick {tick}", file=sys.stderr, flush=True)
    if sc.fault == "exit":
        os._exit(17)
    time.sleep(3 * ctx.timeout_s)  # silent but alive: peers must give up on their own timeouts
    raise PeerError(f"injected stall at tick {tick} ended")


class SendQueue:
    """Outstanding isends from preallocated buffers. Waits only when more than `window` sends
    are queued, so a stage never stalls on a driver that reads its (stale) anchors lazily; each
    (dst, size) has a ring of window + 2 buffers, so a buffer is reused only after its send ended."""

    def __init__(self, ctx: DistContext, window: int, who: str):
        self.ctx, self.window, self.who, self.items = ctx, window, who, deque()  # who: "stage p" or "driver"
        self.rings: dict[tuple[int, int], tuple[list[torch.Tensor], list]] = {}
        self.turn: dict[tuple[int, int], int] = {}

    def send(self, dst: int, nbytes: int, header: list[int]) -> None:
        key = (dst, nbytes)
        if key not in self.rings:
            bufs = [torch.zeros(nbytes, dtype=torch.uint8, device=self.ctx.device) for _ in range(self.window + 2)]
            self.rings[key] = (bufs, [b[:HEADER_BYTES].view(torch.int64) for b in bufs])
            self.turn[key] = 0
        bufs, headers = self.rings[key]
        i = self.turn[key] = (self.turn[key] + 1) % len(bufs)
        stamped = [*header[:4], time.perf_counter_ns()]
        if headers[i].is_cpu:
            headers[i].numpy()[:] = stamped  # a plain memory write; payload bytes stay zero
        else:  # NCCL path (untested): a small host-to-device copy
            headers[i].copy_(torch.tensor(stamped, dtype=torch.int64))
        self.items.append((self.ctx.isend(bufs[i], dst, f"{self.who}: send to rank {dst}"), dst))
        while len(self.items) > self.window:
            self._retire()

    def _retire(self) -> None:
        work, dst = self.items.popleft()
        self.ctx.wait(work, f"{self.who}: send to rank {dst}")

    def drain(self) -> None:
        while self.items:
            self._retire()


class Link:
    """In-order receiver of one stage's driver-bound messages (FIFO per pair), receive pre-posted."""

    def __init__(self, ctx: DistContext, src: int, nbytes: int, stage: int):
        self.ctx, self.src, self.nbytes, self.stage = ctx, src, nbytes, stage
        self.what = f"driver: receive from stage {stage} (rank {src})"
        self.count = 0  # messages received = last entry index seen
        self.last: list[int] = []
        self.buf = torch.empty(nbytes, dtype=torch.uint8, device=ctx.device)
        self._post()

    def _post(self) -> None:
        self.work = self.ctx.irecv(self.buf, self.src, self.what)  # the header was read: the buffer is free

    def _next(self) -> list[int]:
        self.ctx.wait(self.work, self.what)
        header = _header(self.buf)
        if header[0] != KIND_END:
            self._post()
        return header

    def get(self, entry: int) -> list[int]:
        """Header of the message for token `entry` (1-based), receiving older ones on the way."""
        while self.count < entry:
            self.last = self._next()
            self.count += 1
            assert self.last[0] == KIND_TOKEN and self.last[1] == self.count, \
                f"stage {self.stage} sent {self.last} as message {self.count}: FIFO order broken"
        return self.last

    def close(self) -> None:
        while self._next()[0] != KIND_END:
            self.count += 1


def _stage_loop(ctx: DistContext, sc: ReplayConfig, p: int) -> dict:
    n, sizes, last = sc.n, sc.message_bytes(), p == sc.n - 1
    src = 0 if p == 0 else sc.stage_rank(p - 1)
    dst = 0 if last else sc.stage_rank(p + 1)
    in_bytes = sizes["token"] if p == 0 else sizes["activation"]
    out_bytes = sizes["exit"] if last else sizes["activation"]
    sends = SendQueue(ctx, window=4 * n + 8, who=f"stage {p}")
    bufs = [torch.empty(in_bytes, dtype=torch.uint8, device=ctx.device) for _ in range(2)]
    what = f"stage {p}: receive from rank {src}"
    work, i, compute = ctx.irecv(bufs[0], src, what), 0, []
    waited = posting = 0.0
    hops = []  # input latencies of messages this stage was idle-waiting for (ms)
    while True:
        t_wait = time.perf_counter_ns()
        ctx.wait(work, what)
        arrived = time.perf_counter_ns()
        header = _header(bufs[i % 2])
        if header[0] == KIND_END:
            break
        if i > 0:  # the wait for the first token is pipeline fill, not steady-state waiting
            waited += (arrived - t_wait) / 1e9
        if header[4] > t_wait:  # sent while we waited: wait return - send = one hop
            hops.append((arrived - header[4]) / 1e6)
        work = ctx.irecv(bufs[(i + 1) % 2], src, what)  # pre-post the next input before computing
        t0 = time.perf_counter()
        time.sleep(sc.stage_ms[p] / 1e3)
        t1 = time.perf_counter()
        compute.append(t1 - t0)
        sends.send(dst, out_bytes, header)  # downstream first: it is on the critical path
        if not last:
            sends.send(0, sizes["anchors"], header)
        posting += time.perf_counter() - t1
        i += 1
        _maybe_fail(ctx, sc, header[1] + p)  # token `entry` is at stage p in tick entry + p
    end = [KIND_END, 0, 0, 0, 0]
    if not last:
        sends.send(dst, out_bytes, end)
    sends.send(0, sizes["exit"] if last else sizes["anchors"], end)
    sends.drain()
    per_token_ms = 1e3 / max(1, i)  # seconds summed over tokens -> ms per token
    return {"stage": p, "tokens_computed": i, "compute_ms": sum(compute) * per_token_ms,
            "wait_input_ms": waited * per_token_ms, "post_ms": posting * per_token_ms,
            "input_hop_ms": sum(hops) / len(hops) if hops else None}


class _Driver:
    """Rank 0's side of the replay: PDM rows, verification, epochs and its own timers."""

    def __init__(self, ctx: DistContext, sc: ReplayConfig):
        self.ctx, self.sc, self.n, self.sizes = ctx, sc, sc.n, sc.message_bytes()
        self.rng = random.Random(sc.seed)
        self.links = {p: Link(ctx, sc.stage_rank(p), self.sizes["exit" if p == sc.n - 1 else "anchors"], p)
                      for p in range(1 if sc.colocate else 0, sc.n)}
        self.sends = SendQueue(ctx, window=4 * sc.n + 8, who="driver")
        self.epoch_of = [-1, 0]  # entry index (1-based) -> epoch it was sent with; entry 1 is x_P
        self.epoch = self.committed = self.rejects = 0
        self.last_rejected = False
        self.stage0: list[float] = []
        self.busy = {"wait_anchors": 0.0, "pdm": 0.0, "wait_exit": 0.0, "verify": 0.0}  # seconds, summed

    def send_token(self, entry: int) -> None:
        dst = self.sc.stage_rank(0)
        self.sends.send(dst, self.sizes["token"], [KIND_TOKEN, entry, self.epoch_of[entry], 0])

    def run_stage0(self, tick: int) -> None:
        """Co-located: stage 0 runs on this rank first, so its output leaves early."""
        t0 = time.perf_counter()
        time.sleep(self.sc.stage_ms[0] / 1e3)
        self.stage0.append(time.perf_counter() - t0)
        self.sends.send(self.sc.stage_rank(1), self.sizes["activation"], [KIND_TOKEN, tick, self.epoch_of[tick], 0])

    def read_anchors(self, tick: int) -> None:
        """The anchors of tick-1 that this tick's PDM rows need: current-epoch tokens only."""
        t0 = time.perf_counter()
        for p, link in self.links.items():
            entry = tick - 1 - p
            if p < self.n - 1 and entry >= 1 and self.epoch_of[entry] == self.epoch:
                header = link.get(entry)
                assert header[2] == self.epoch, f"stage {p} anchors carry epoch {header[2]}"
        self.busy["wait_anchors"] += time.perf_counter() - t0

    def pdm(self) -> None:
        t0 = time.perf_counter()
        time.sleep(self.sc.pdm_ms / 1e3)
        self.busy["pdm"] += time.perf_counter() - t0

    def verify(self, tick: int) -> bool:
        """Verify the oldest token if it is current; True when the run has all its tokens."""
        exiting = tick - self.n + 1
        if exiting < 1 or self.epoch_of[exiting] != self.epoch:
            return False  # pipeline fill or refill: nothing to verify this tick
        t0 = time.perf_counter()
        header = self.links[self.n - 1].get(exiting)
        assert header[2] == self.epoch, "exit epoch disagrees with the driver"
        t1 = time.perf_counter()
        time.sleep(self.sc.verify_ms / 1e3)
        self.busy["wait_exit"] += t1 - t0
        self.busy["verify"] += time.perf_counter() - t1
        self.committed += 1
        self.last_rejected = self.rng.random() >= self.sc.alpha
        if self.last_rejected:  # commit the correction; everything in flight is stale now
            self.epoch += 1
            self.rejects += 1
        return self.committed == self.sc.tokens - 1

    def close(self) -> None:
        end = [KIND_END, 0, 0, 0, 0]
        first = 1 if self.sc.colocate else 0
        self.sends.send(self.sc.stage_rank(first), self.sizes["activation" if first else "token"], end)
        for link in self.links.values():
            link.close()
        self.sends.drain()


def _driver_loop(ctx: DistContext, sc: ReplayConfig) -> dict:
    drv = _Driver(ctx, sc)
    ctx.barrier("replay start barrier")
    t_start = time.perf_counter()
    if not sc.colocate:
        drv.send_token(1)
    tick = 0
    while True:
        tick += 1
        _maybe_fail(ctx, sc, tick)
        if sc.colocate:
            drv.run_stage0(tick)
        drv.read_anchors(tick)
        drv.pdm()
        if drv.verify(tick):
            break
        drv.epoch_of.append(drv.epoch)  # the next token (draft or correction) carries the current epoch
        if not sc.colocate:
            drv.send_token(tick + 1)
    wall = time.perf_counter() - t_start
    drv.close()
    return _driver_result(drv, tick, wall)


def _driver_result(drv: _Driver, ticks: int, wall_s: float) -> dict:
    sc, n = drv.sc, drv.n
    r_counted = drv.rejects - (1 if drv.last_rejected else 0)  # a final correction costs no refill
    assert ticks == (sc.tokens - 1) + (n - 1) * (1 + r_counted), "tick count disagrees with docs/design.md 3.3"
    tick_ms = 1e3 * wall_s / ticks
    slowest = max(sc.stage_ms)
    return {
        "n": n, "colocate": sc.colocate, "stage_ms": list(sc.stage_ms), "pdm_ms": sc.pdm_ms,
        "verify_ms": sc.verify_ms, "alpha": sc.alpha, "seed": sc.seed, "hidden": sc.hidden,
        "dtype_bytes": sc.dtype_bytes, "anchors": sc.anchors, "message_bytes": drv.sizes,
        "tokens": sc.tokens, "ticks": ticks, "rejections": r_counted,
        "alpha_measured": 1.0 - drv.rejects / drv.committed,
        "eal": n * (sc.tokens - 1) / ticks,
        "eal_formula": n / (1 + (n - 1) * (1 - sc.alpha)),
        "wall_ms": 1e3 * wall_s,
        "tick_ms": tick_ms,
        "decode_tok_s": (sc.tokens - 1) / wall_s,
        "pure_compute_ms": slowest,
        "overhead_ms": tick_ms - slowest,
        "overhead_pct": 100.0 * (tick_ms - slowest) / slowest if slowest > 0 else float("nan"),
        "stage0_compute_ms": 1e3 * sum(drv.stage0) / len(drv.stage0) if drv.stage0 else None,
        "driver_ms_per_tick": {k: 1e3 * v / ticks for k, v in drv.busy.items()},
        "pdm_ms_measured": 1e3 * drv.busy["pdm"] / ticks,
        "verify_ms_measured": 1e3 * drv.busy["verify"] / drv.committed,
    }


def run_scenario(ctx: DistContext, sc: ReplayConfig) -> dict | None:
    """Run one scenario on this rank: the driver returns its result, a stage its compute stats."""
    sc.validate(ctx.world_size)
    stage = ctx.rank if sc.colocate else ctx.rank - 1
    if ctx.rank == 0:
        result = _driver_loop(ctx, sc)
    else:
        ctx.barrier("replay start barrier")
        result = _stage_loop(ctx, sc, stage) if 0 <= stage < sc.n else None  # spare ranks idle
    ctx.barrier("replay end barrier")
    return result


def run_scenarios(ctx: DistContext, scenarios: list[ReplayConfig]) -> list[dict | None]:
    return [run_scenario(ctx, sc) for sc in scenarios]


def merge_replay(per_rank: list[list[dict | None]]) -> list[dict]:
    """Rank 0's results with each stage's measured compute time filled in."""
    merged = []
    for i, result in enumerate(per_rank[0]):
        assert result is not None, "the driver always reports"
        measured, waits, posts, hops = ([None] * result["n"] for _ in range(4))
        if result["stage0_compute_ms"] is not None:
            measured[0] = result["stage0_compute_ms"]
        for rank_results in per_rank[1:]:
            stats = rank_results[i]
            if stats is not None:
                measured[stats["stage"]] = stats["compute_ms"]
                waits[stats["stage"]] = stats["wait_input_ms"]
                posts[stats["stage"]] = stats["post_ms"]
                hops[stats["stage"]] = stats["input_hop_ms"]
        merged.append({**result, "stage_compute_ms_measured": measured, "stage_wait_input_ms": waits,
                       "stage_post_ms": posts, "stage_input_hop_ms": hops})
    return merged


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

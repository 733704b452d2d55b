"""The runtime's own hop: one-way latency of a message through the engine's Transport (`spd
netbench --tests transport`), for the gloo frame transport and the shared-memory rings.

netbench's `p2p` test times raw isend/irecv pairs; a tick's message goes through the transport
instead (a header and its payloads in one frame or one ring record, engine/transport.py and
engine/shm_transport.py), so this is the hop the tick-cost accounting compares against. Each
size is ping-ponged `iters` times between the pairs' ends; optionally the responder computes
for `busy_us` before it answers, as a stage does, so the sender's message meets a busy peer.
"""
from __future__ import annotations

import time

import torch

from spd_engine.bench.stats import summarize_us
from spd_engine.engine.messages import Header, Kind
from spd_engine.engine.shm_transport import ShmTransport, shm_usable
from spd_engine.engine.transport import DistTransport, Transport

TRANSPORT_KINDS = ("gloo", "shm")


def _spin(us: float) -> None:
    """Busy the core for `us` microseconds (a stage's compute)."""
    end = time.perf_counter() + us / 1e6
    while time.perf_counter() < end:
        pass


def _pingpong(t: Transport, peer: int, nbytes: int, iters: int, initiator: bool, busy_us: float,
              timeout: float) -> list[float] | None:
    """The initiator's round trips (s) of header + `nbytes` payload each way."""
    out = torch.zeros(max(1, nbytes // 4), dtype=torch.float32)  # [nbytes / 4]
    back = torch.empty_like(out)
    hdr = Header(Kind.TOKEN, 0, 1)
    rtts = []
    for i in range(iters):
        if initiator:
            t0 = time.perf_counter()
            t.send(peer, hdr, [out])
            t.recv_header(peer, timeout, i)
            t.recv_into(peer, back, timeout, i)
            rtts.append(time.perf_counter() - t0)
        else:
            t.recv_header(peer, timeout, i)
            t.recv_into(peer, back, timeout, i)
            _spin(busy_us)
            t.send(peer, hdr, [back])
    end = Header(Kind.END, 0, 1)  # lands in the receive each side posted after its last frame
    if initiator:
        t.send(peer, end)
        t.recv_header(peer, timeout)
    else:
        t.recv_header(peer, timeout)
        t.send(peer, end)
    t.flush()
    return rtts if initiator else None


def transport_bench(ctx, pairs: list[tuple[int, int]], sizes: list[int], iters: int, busy_us: float
                    ) -> list[dict]:
    """Rows {transport, a, b, bytes, busy_us, one-way summary (us)} for each transport this host can
    run (shm needs CPU ranks of one host); collective over the default group."""
    rows = []
    for kind in TRANSPORT_KINDS:
        if kind == "shm" and (ctx.device.type != "cpu" or shm_usable(ctx.world_size) is not None):
            continue
        t = ShmTransport(ctx.rank, ctx.world_size) if kind == "shm" else DistTransport(ctx.rank, ctx.world_size,
                                                                                      ctx.device)
        for a, b in pairs:
            for nbytes in sizes:
                if kind == "gloo":  # frames that hold the payload, as a decode tick's messages
                    t.set_frames({(a, b): 4 * max(1, nbytes // 4), (b, a): 4 * max(1, nbytes // 4)})
                if ctx.rank in (a, b):
                    peer = b if ctx.rank == a else a
                    _pingpong(t, peer, nbytes, 5, ctx.rank == a, busy_us, ctx.timeout_s)  # warm-up
                    rtts = _pingpong(t, peer, nbytes, iters, ctx.rank == a, busy_us, ctx.timeout_s)
                    if rtts is not None:
                        one_way = [(r - busy_us / 1e6) / 2 for r in rtts]
                        rows.append({"transport": kind, "a": a, "b": b, "bytes": nbytes, "busy_us": busy_us,
                                     **summarize_us(one_way)})
                ctx.barrier(f"barrier after transport {kind} {a}-{b} {nbytes}B")
        t.close()
    return rows

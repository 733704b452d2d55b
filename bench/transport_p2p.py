"""The runtime's own hop: one-way latency of a message through the engine's Transport (`spd
netbench --tests transport`), for the gloo frame transport and the shared-memory rings.

netbench's `p2p` test times raw isend/irecv pairs; a tick's message goes through the transport
instead (a header and its payloads in one frame or one ring record, engine/comm/transport.py and
engine/comm/shm_transport.py), so this is the hop the tick-cost accounting compares against. Each
size is ping-ponged `iters` times between the pairs' ends; optionally the responder computes
for `busy_us` before it answers, as a stage does, so the sender's message meets a busy peer.

`busy_mb` makes the compute real: before each send both ends stream that many MiB of float32
weights through matrix-vector products, the memory traffic of a decode step, so every send and
receive runs on caches as a decoding rank leaves them (on a CPU rank this is what a tick's
messages meet: the weights have evicted the interpreter's and the transport's working set). Each
end times its own compute (the responder's travels back in the reply header's `reply` field, in
ns) and the round trip is counted without both.
"""
from __future__ import annotations

import time

import torch

from spd_engine.bench.stats import summarize_us
from spd_engine.engine.comm.shm_transport import ShmTransport, shm_usable
from spd_engine.engine.comm.transport import DistTransport, Transport, with_link_delay
from spd_engine.engine.protocol.messages import Header, Kind

TRANSPORT_KINDS = ("gloo", "shm")


def _spin(us: float) -> None:
    """Busy the core for `us` microseconds (a stage's compute)."""
    end = time.perf_counter() + us / 1e6
    while time.perf_counter() < end:
        pass


def stream_weights(busy_mb: float) -> list[torch.Tensor]:
    """float32 [1024, 1024] blocks of about `busy_mb` MiB in all (none for 0)."""
    return [torch.rand(1024, 1024) for _ in range(round(busy_mb / 4))]


def _compute(weights: list[torch.Tensor], x: torch.Tensor, busy_us: float) -> float:
    """Stream `weights` (matrix-vector products, x [1024]) and spin `busy_us`; the seconds it took."""
    t0 = time.perf_counter()
    for w in weights:
        torch.mv(w, x)
    _spin(busy_us)
    return time.perf_counter() - t0


def _pingpong(t: Transport, peer: int, nbytes: int, iters: int, initiator: bool, busy_us: float,
              timeout: float, weights: list[torch.Tensor] = ()) -> list[float] | None:
    """The initiator's round trips (s) of header + `nbytes` payload each way, less both ends' compute."""
    out = torch.zeros(max(1, nbytes // 4), dtype=torch.float32)  # [nbytes / 4]
    back = torch.empty_like(out)
    t.pin(out)  # the tick's decode buffers are pinned the same way (engine/comm/transport.py Transport.pin)
    t.pin(back)
    x = torch.rand(1024)
    hdr = Header(Kind.TOKEN, 0, 1)
    rtts = []
    for i in range(iters):
        if initiator:
            t0 = time.perf_counter()
            own = _compute(weights, x, 0.0)
            t.send(peer, hdr, [out])
            reply = t.recv_header(peer, timeout, i)
            t.recv_into(peer, back, timeout, i)
            rtts.append(time.perf_counter() - t0 - own - reply.reply / 1e9)
        else:
            t.recv_header(peer, timeout, i)
            t.recv_into(peer, back, timeout, i)
            busy = _compute(weights, x, busy_us)
            t.send(peer, Header(Kind.TOKEN, 0, 1, reply=round(busy * 1e9)), [back])
    end = Header(Kind.END, 0, 1)  # lands in the receive each side posted after its last frame
    if initiator:
        t.send(peer, end)
        t.recv_header(peer, timeout)
    else:
        t.recv_header(peer, timeout)
        t.send(peer, end)
    t.flush()
    return rtts if initiator else None


def transport_bench(ctx, pairs: list[tuple[int, int]], sizes: list[int], iters: int, busy_us: float,
                    busy_mb: float = 0.0, link_delay_us: float = 0.0) -> list[dict]:
    """Rows {transport, a, b, bytes, busy_us, busy_mb, link_delay_us, one-way summary (us)} for each
    transport this host can run (shm needs CPU ranks of one host), with the emulated link latency
    `link_delay_us` added as a run adds it; collective over the default group."""
    rows = []
    weights = stream_weights(busy_mb)
    for kind in TRANSPORT_KINDS:
        if kind == "shm" and (ctx.device.type != "cpu" or shm_usable(ctx.world_size) is not None):
            continue
        t = ShmTransport(ctx.rank, ctx.world_size) if kind == "shm" else DistTransport(ctx.rank, ctx.world_size,
                                                                                      ctx.device)
        t = with_link_delay(t, link_delay_us)
        for a, b in pairs:
            for nbytes in sizes:
                if kind == "gloo":  # frames that hold the payload, as a decode tick's messages
                    t.set_frames({(a, b): 4 * max(1, nbytes // 4), (b, a): 4 * max(1, nbytes // 4)})
                if ctx.rank in (a, b):
                    peer = b if ctx.rank == a else a
                    _pingpong(t, peer, nbytes, 5, ctx.rank == a, busy_us, ctx.timeout_s, weights)  # warm-up
                    rtts = _pingpong(t, peer, nbytes, iters, ctx.rank == a, busy_us, ctx.timeout_s, weights)
                    if rtts is not None:
                        rows.append({"transport": kind, "a": a, "b": b, "bytes": nbytes, "busy_us": busy_us,
                                     "busy_mb": busy_mb, "link_delay_us": link_delay_us, **summarize_us([r / 2 for r in rtts])})
                ctx.barrier(f"barrier after transport {kind} {a}-{b} {nbytes}B")
        t.close()
    return rows

"""Point-to-point transport: a small interface, a torch.distributed implementation and an
in-process one (threads in one process: tests and the reference executor).

A message is a header plus zero or more payload tensors whose shapes the receiver derives
from the header (engine/protocol/messages.py WireFormat), so every receive lands in a preallocated buffer.
The distributed transport sends each message as one fixed-size frame per link (header, then
the payloads inline when they fit the link's frame capacity, else as further messages): a
decode tick costs one message per hop, and the next frame's receive is posted as soon as the
current one arrives, so data lands while the receiver computes. Receives inside a request
time out with an error naming (rank, peer, tick); a dead peer surfaces as the same error.
Per-link FIFO order is what the lazy rollback of docs/design.md 3.4 relies on: torch.distributed P2P
within one process group between a fixed pair of ranks and the in-process queues both preserve
it (the distributed transport uses one group per direction of each pair).
"""
from __future__ import annotations

import abc
import datetime
import os
import queue
import threading
import time
from collections.abc import Sequence

import numpy as np
import torch

from spd_engine.engine.protocol.messages import HEADER_LEN, Header, Kind

FRAME_INTS = HEADER_LEN + 1  # the header, then 1 if the payloads are inside the frame, 0 if they follow
FRAME_HEAD = 8 * FRAME_INTS  # bytes before the inline payloads
SEND_FRAMES = 8  # frames in flight per destination before a send waits for the oldest


class TransportError(RuntimeError):
    """A receive timed out or a peer died; the message names (rank, peer, tick)."""

    def __init__(self, rank: int, peer: int, tick: int, what: str) -> None:
        super().__init__(f"rank {rank}: {what} (rank={rank}, peer={peer}, tick={tick})")
        self.rank, self.peer, self.tick = rank, peer, tick


class Transport(abc.ABC):
    rank: int
    world_size: int
    # whether `pin` makes a pinned buffer's messages cheaper (then a stage's decode outputs land in
    # pinned rows); elsewhere a copy into them would be one more kernel per step on a GPU, for nothing
    pins_buffers: bool = False

    @abc.abstractmethod
    def send(self, dst: int, header: Header, payloads: Sequence[torch.Tensor] = ()) -> None:
        """Queue a message. Every transport copies the payloads (or their bytes) before it returns
        (on a GPU: enqueues the copy on the current stream, ahead of any later write to them), so
        the caller may reuse its buffers at once (a stage's pinned output row, every tick)."""

    @abc.abstractmethod
    def recv_header(self, src: int, timeout: float | None, tick: int = -1) -> Header:
        """Next header from src; timeout None waits forever (idle between requests)."""

    @abc.abstractmethod
    def recv_into(self, src: int, out: torch.Tensor, timeout: float | None, tick: int = -1) -> torch.Tensor:
        """Next payload from src, written into the contiguous buffer `out`."""

    def ready(self, src: int) -> bool:
        """Whether the next message from src has arrived, so that reading its header would not wait
        (False where the transport cannot tell: the caller then reads where it would anyway)."""
        return False

    def flush(self) -> None:
        """Wait until every queued send has left."""

    def pin(self, t: torch.Tensor) -> None:
        """`t` is a buffer this rank sends from or receives into again and again (a decode tick's):
        a transport may keep what it needs to move its bytes fast. The caller keeps it alive and
        never resizes it. Transports that gain nothing from it ignore it."""

    def close(self) -> None:
        self.flush()

    def set_frames(self, capacities: dict[tuple[int, int], int]) -> None:
        """Inline payload bytes per directed link (src rank, dst rank); both ends of a link must
        be given the same value. Transports without frames ignore it."""


# Idle waits (between requests) must outlast any pause of the caller; gloo bounds a wait
# without an explicit timeout by the process group's timeout, so they pass this one instead.
IDLE_TIMEOUT = datetime.timedelta(days=7)


def directional_groups(rank: int, world_size: int) -> dict[tuple[int, int], object]:
    """{(src, dst): a two-rank process group that carries src -> dst messages only}, for the
    pairs this rank belongs to. NCCL runs all P2P between two ranks of one communicator on one
    stream in issue order, and a send may wait for its receive: with one group per pair, two
    ranks that both send before receiving (the driver and stage 0 every tick) can deadlock. One
    communicator per direction keeps the directions independent and each FIFO. `new_group` is
    collective over the default group, so every rank creates every group, in the same order."""
    import torch.distributed as dist

    groups = {}
    for src in range(world_size):
        for dst in range(world_size):
            if src != dst:
                group = dist.new_group([src, dst])
                if rank in (src, dst):
                    groups[(src, dst)] = group
    return groups


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's storage as a flat uint8 view."""
    return t.reshape(-1).view(torch.uint8)


class _Rx:
    """Receive state of one link: two frames (one being read, one being filled), the posted
    receive, and where the inline payloads of the current frame continue."""

    def __init__(self, nbytes: int, device: torch.device) -> None:
        self.frames = [torch.zeros(nbytes, dtype=torch.uint8, device=device) for _ in range(2)]
        self.posted = None  # the irecv work filling frames[self.next]
        self.next = 0
        self.cur = 1
        self.inline = False
        self.offset = FRAME_HEAD


class DistTransport(Transport):
    """torch.distributed isend/irecv (gloo on CPU, NCCL on GPU), one process group per direction
    of each rank pair (directional_groups). Every message is one frame of FRAME_HEAD + capacity
    bytes on its link (set_frames; capacity 0 by default: payloads follow as separate messages).
    Tensors on another device than the transport's (small host-side payloads: sampling settings,
    stage statistics) are staged through its device, since NCCL moves only GPU memory.
    Collective over the default group: every rank constructs its transport."""

    def __init__(self, rank: int, world_size: int, device: torch.device | str = "cpu") -> None:
        self.rank, self.world_size, self.device = rank, world_size, torch.device(device)
        self._pending: list[tuple[object, torch.Tensor]] = []  # (work, tensor kept alive): separate payloads
        self._groups = directional_groups(rank, world_size)
        self._caps: dict[tuple[int, int], int] = {}
        self._tx: dict[int, list[list]] = {}  # dst -> [[frame, work or None]] * SEND_FRAMES, round robin
        self._tx_next: dict[int, int] = {}
        self._rx: dict[int, _Rx] = {}

    def set_frames(self, capacities: dict[tuple[int, int], int]) -> None:
        """Between runs only: every send has left and no receive is posted (both ends of a link
        switch at the same point of the message stream)."""
        assert all(rx.posted is None for rx in self._rx.values()), "a frame receive is still posted"
        self.flush()
        self._tx.clear()
        self._rx.clear()
        self._caps = {link: int(c) for link, c in capacities.items() if self.rank in link}

    def _frame_bytes(self, src: int, dst: int) -> int:
        return FRAME_HEAD + self._caps.get((src, dst), 0)

    def _new_slot(self, nbytes: int) -> list:
        """[frame, send work or None, host int64 view of the frame head, host staging or None]."""
        frame = torch.zeros(nbytes, dtype=torch.uint8, device=self.device)
        host = None if self.device.type == "cpu" else torch.zeros(FRAME_HEAD, dtype=torch.uint8).pin_memory()
        head = (frame[:FRAME_HEAD] if host is None else host).numpy().view(np.int64)  # written in place
        return [frame, None, head, host]

    def _send_frame(self, dst: int) -> list:
        """A free frame slot for dst (waits for the oldest send when all are in flight)."""
        pool = self._tx.get(dst)
        if pool is None:
            pool = self._tx[dst] = [self._new_slot(self._frame_bytes(self.rank, dst)) for _ in range(SEND_FRAMES)]
            self._tx_next[dst] = 0
        i = self._tx_next[dst]
        self._tx_next[dst] = (i + 1) % SEND_FRAMES
        slot = pool[i]
        if slot[1] is not None:
            slot[1].wait()  # rare: SEND_FRAMES messages to dst still in flight
            slot[1] = None
        return slot

    def send(self, dst: int, header: Header, payloads: Sequence[torch.Tensor] = ()) -> None:
        import torch.distributed as dist

        self._pending = [(w, t) for w, t in self._pending if not w.is_completed()]
        cap = self._caps.get((self.rank, dst), 0)
        sizes = [p.numel() * p.element_size() for p in payloads]
        inline = sum(sizes) <= cap
        slot = self._send_frame(dst)
        frame, _, head, host = slot
        head[:HEADER_LEN] = header.to_ints()
        head[HEADER_LEN] = int(inline)
        if host is not None:  # device frame: the head goes up from its own pinned staging buffer
            frame[:FRAME_HEAD].copy_(host, non_blocking=True)
        if inline:
            offset = FRAME_HEAD
            for p, nb in zip(payloads, sizes):
                frame[offset:offset + nb].copy_(_bytes(p.to(self.device).contiguous()))
                offset += nb
        group = self._groups[(self.rank, dst)]
        try:
            slot[1] = dist.isend(frame, dst, group=group)
            if not inline:  # a copy, kept until the send completes: the caller may reuse its buffer now
                for p in payloads:
                    p = p.detach().to(self.device, copy=True, memory_format=torch.contiguous_format)
                    self._pending.append((dist.isend(p, dst, group=group), p))
        except RuntimeError as err:
            raise TransportError(self.rank, dst, -1, f"send failed: {err}") from err

    def _wait(self, work, src: int, timeout: float | None, tick: int) -> None:
        try:
            if timeout is None:
                work.wait(timeout=IDLE_TIMEOUT)
            else:
                work.wait(timeout=datetime.timedelta(seconds=timeout))
        except RuntimeError as err:
            what = "timed out" if "Timed out" in str(err) else "peer failed"
            raise TransportError(self.rank, src, tick, f"receive {what} after {timeout}s: {err}") from err

    def _post(self, src: int, rx: _Rx) -> None:
        import torch.distributed as dist

        try:
            rx.posted = dist.irecv(rx.frames[rx.next], src, group=self._groups[(src, self.rank)])
        except RuntimeError as err:
            raise TransportError(self.rank, src, -1, f"receive failed at posting: {err}") from err

    def recv_header(self, src: int, timeout: float | None, tick: int = -1) -> Header:
        rx = self._rx.get(src)
        if rx is None:
            rx = self._rx[src] = _Rx(self._frame_bytes(src, self.rank), self.device)
        if rx.posted is None:
            self._post(src, rx)
        work, rx.posted = rx.posted, None
        self._wait(work, src, timeout, tick)
        rx.cur, rx.next = rx.next, rx.cur
        ints = rx.frames[rx.cur][:FRAME_HEAD].view(torch.int64).tolist()  # host sync: the header decides
        hdr = Header.from_ints(ints[:HEADER_LEN])
        rx.inline, rx.offset = bool(ints[HEADER_LEN]), FRAME_HEAD
        if rx.inline and hdr.kind in (Kind.TOKEN, Kind.PREFILL, Kind.BATCH):
            self._post(src, rx)  # mid-request: the next frame lands while this one is used
        return hdr

    def ready(self, src: int) -> bool:
        rx = self._rx.get(src)
        return rx is not None and rx.posted is not None and rx.posted.is_completed()

    def recv_into(self, src: int, out: torch.Tensor, timeout: float | None, tick: int = -1) -> torch.Tensor:
        import torch.distributed as dist

        assert out.is_contiguous()
        rx = self._rx[src]
        if rx.inline:  # the payload came inside the frame
            nb = out.numel() * out.element_size()
            assert rx.offset + nb <= rx.frames[rx.cur].numel(), (rx.offset, nb, "payload beyond the frame")
            data = rx.frames[rx.cur][rx.offset:rx.offset + nb]
            rx.offset += nb
            if out.device == self.device:
                _bytes(out).copy_(data)
            else:
                out.copy_(data.view(out.dtype).view(out.shape))
            return out
        group = self._groups[(src, self.rank)]
        if out.device != self.device:  # e.g. a host buffer on an NCCL transport
            staged = torch.empty_like(out, device=self.device)
            self._wait(dist.irecv(staged, src, group=group), src, timeout, tick)
            return out.copy_(staged)
        self._wait(dist.irecv(out, src, group=group), src, timeout, tick)
        return out

    def flush(self) -> None:
        for work, _ in self._pending:
            work.wait()
        self._pending.clear()
        for pool in self._tx.values():
            for slot in pool:
                if slot[1] is not None:
                    slot[1].wait()
                    slot[1] = None

    def abandon(self) -> None:
        """Forget queued sends and posted receives without waiting (the run is failing; the peers
        may be gone), and drop the groups, so that destroying the process group really closes
        their connections (a peer blocked on one of them then fails at once instead of waiting
        for its timeout)."""
        self._pending.clear()
        self._tx.clear()
        self._rx.clear()
        self._groups.clear()


class LocalHub:
    """Shared state of in-process transports: one FIFO queue per (src, dst) link."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        # SimpleQueue, not Queue: its put and get are C calls, where Queue's take a Python Condition
        # each; with the ranks as threads every message crosses one (about a tenth of a tiny
        # model's CPU time per request, docs/results/test-durations.md)
        self.links = {(s, d): queue.SimpleQueue() for s in range(world_size) for d in range(world_size)}
        self.dead: set[int] = set()
        self.lock = threading.Lock()

    def transport(self, rank: int) -> "LocalTransport":
        return LocalTransport(self, rank)


class LocalTransport(Transport):
    """In-process transport over queues; payloads are copied at send time."""

    POLL_S = 0.05

    def __init__(self, hub: LocalHub, rank: int) -> None:
        self.hub, self.rank, self.world_size = hub, rank, hub.world_size

    def send(self, dst: int, header: Header, payloads: Sequence[torch.Tensor] = ()) -> None:
        if dst in self.hub.dead:
            raise TransportError(self.rank, dst, -1, "send failed: peer is dead")
        link = self.hub.links[(self.rank, dst)]
        link.put(header)
        for p in payloads:
            link.put(p.detach().clone())

    def _get(self, src: int, timeout: float | None, tick: int):
        link = self.hub.links[(src, self.rank)]
        waited = 0.0
        while True:
            if src in self.hub.dead and link.empty():
                raise TransportError(self.rank, src, tick, "receive failed: peer is dead")
            try:
                return link.get(timeout=self.POLL_S)
            except queue.Empty:
                waited += self.POLL_S
                if timeout is not None and waited >= timeout:
                    raise TransportError(self.rank, src, tick, f"receive timed out after {timeout}s") from None

    def recv_header(self, src: int, timeout: float | None, tick: int = -1) -> Header:
        item = self._get(src, timeout, tick)
        assert isinstance(item, Header), f"rank {self.rank}: expected a header from {src}, got a payload"
        return item

    def ready(self, src: int) -> bool:
        return not self.hub.links[(src, self.rank)].empty()

    def recv_into(self, src: int, out: torch.Tensor, timeout: float | None, tick: int = -1) -> torch.Tensor:
        item = self._get(src, timeout, tick)
        assert isinstance(item, torch.Tensor), f"rank {self.rank}: expected a payload from {src}, got {item}"
        if item.shape != out.shape:
            raise TransportError(self.rank, src, tick, f"payload shape {tuple(item.shape)} != expected {tuple(out.shape)}")
        out.copy_(item)
        return out

    def mark_dead(self) -> None:
        self.hub.dead.add(self.rank)


class LoopbackTransport(Transport):
    """A rank's view of a transport that can also message itself (co-located driver + stage 0).

    Messages to self go to `out_fifo` and come from `in_fifo`; the driver's and the local stage
    worker's views swap the two (see `loopback_pair`). The stage-0 step runs inline right after
    the driver sends to it, so a self-receive never has to wait.
    """

    def __init__(self, inner: Transport, out_fifo: queue.SimpleQueue, in_fifo: queue.SimpleQueue) -> None:
        self.inner, self.rank, self.world_size = inner, inner.rank, inner.world_size
        self.pins_buffers = inner.pins_buffers
        self._out, self._in = out_fifo, in_fifo

    def send(self, dst: int, header: Header, payloads: Sequence[torch.Tensor] = ()) -> None:
        if dst != self.rank:
            return self.inner.send(dst, header, payloads)
        self._out.put(header)
        for p in payloads:
            self._out.put(p.detach().clone())

    def _pop(self, tick: int):
        try:
            return self._in.get_nowait()
        except queue.Empty:
            raise AssertionError(f"rank {self.rank}: self-receive with nothing queued (tick {tick})") from None

    def recv_header(self, src: int, timeout: float | None, tick: int = -1) -> Header:
        if src != self.rank:
            return self.inner.recv_header(src, timeout, tick)
        item = self._pop(tick)
        assert isinstance(item, Header), item
        return item

    def ready(self, src: int) -> bool:
        return self.inner.ready(src) if src != self.rank else not self._in.empty()

    def recv_into(self, src: int, out: torch.Tensor, timeout: float | None, tick: int = -1) -> torch.Tensor:
        if src != self.rank:
            return self.inner.recv_into(src, out, timeout, tick)
        item = self._pop(tick)
        assert isinstance(item, torch.Tensor) and item.shape == out.shape, (item, out.shape)
        return out.copy_(item)

    def flush(self) -> None:
        self.inner.flush()

    def set_frames(self, capacities: dict[tuple[int, int], int]) -> None:
        self.inner.set_frames(capacities)

    def pin(self, t: torch.Tensor) -> None:
        self.inner.pin(t)

    def mark_dead(self) -> None:
        if hasattr(self.inner, "mark_dead"):
            self.inner.mark_dead()


def hold_until(due_ns: int) -> None:
    """Return at wall-clock time `due_ns` (time.time_ns). The last millisecond is a busy wait: a
    sleep or a yield on a busy host hands the core to another process for a scheduler slice
    (milliseconds; a ping-pong with a 300 us hold measured 1.5-4 ms one way on a loaded 2-core
    host), far above the latencies emulated. So a rank uses its core while it holds a message."""
    while (left := due_ns - time.time_ns()) > 0:
        if left > 1_500_000:
            time.sleep((left - 1_000_000) / 1e9)


class DelayedTransport(Transport):
    """An emulated link latency (RunConfig.parallel.link_delay_us): every message to another rank reaches
    its receiver `delay_us` later than the underlying link delivers it. The sender stamps its wall
    clock into a leading 8-byte payload and goes on at once (a rank sending to two peers pays the
    delay once, as on a real link). A receiver that waits for a message holds it `delay_us` past
    its arrival (one way = the link's own time + the delay); one already queued when the receive
    began (it came while the rank computed) is held only until its stamp + the delay, so it pays
    what is left of the delay. The stamp is the sender's wall clock: exact for ranks of one host
    (network-namespace nodes, the shared-memory rings); across hosts their clock offset adds to
    it. Bandwidth is not emulated here (namespace nodes shape it with tc's token bucket,
    docs/cluster.md)."""

    STAMP_BYTES = 8

    def __init__(self, inner: Transport, delay_us: float, remote: frozenset[int] | None = None) -> None:
        """remote: the ranks whose messages cross the emulated link (None: every other rank)."""
        assert delay_us > 0, delay_us
        self.inner, self.rank, self.world_size = inner, inner.rank, inner.world_size
        self.pins_buffers = inner.pins_buffers
        self.delay_ns = round(delay_us * 1e3)
        self.remote = frozenset(r for r in range(self.world_size) if r != self.rank) if remote is None else remote
        self._tx = torch.zeros(1, dtype=torch.int64)  # the transport copies it at send: reused
        self._rx = torch.zeros(1, dtype=torch.int64)
        inner.pin(self._tx)
        inner.pin(self._rx)

    def send(self, dst: int, header: Header, payloads: Sequence[torch.Tensor] = ()) -> None:
        if dst not in self.remote:
            return self.inner.send(dst, header, payloads)
        self._tx[0] = time.time_ns()
        self.inner.send(dst, header, (self._tx, *payloads))

    def recv_header(self, src: int, timeout: float | None, tick: int = -1) -> Header:
        if src not in self.remote:
            return self.inner.recv_header(src, timeout, tick)
        queued = self.inner.ready(src)
        header = self.inner.recv_header(src, timeout, tick)
        # waited for: it arrived just now, so the link's own time (now - sent) is part of its trip
        # and the delay comes on top; queued: it arrived while this rank computed, at a time the
        # transport does not keep, so the delay counts from the send
        arrived = None if queued else time.time_ns()
        self.inner.recv_into(src, self._rx, timeout, tick)
        hold_until((int(self._rx[0]) if arrived is None else arrived) + self.delay_ns)
        return header

    def recv_into(self, src: int, out: torch.Tensor, timeout: float | None, tick: int = -1) -> torch.Tensor:
        return self.inner.recv_into(src, out, timeout, tick)

    def ready(self, src: int) -> bool:
        return self.inner.ready(src)  # arrived, perhaps not yet due: its receive holds the rest

    def flush(self) -> None:
        self.inner.flush()

    def close(self) -> None:
        self.inner.close()

    def pin(self, t: torch.Tensor) -> None:
        self.inner.pin(t)

    def set_frames(self, capacities: dict[tuple[int, int], int]) -> None:
        stamped = lambda link: link[0] in self.remote or link[1] in self.remote  # noqa: E731
        self.inner.set_frames({link: c + self.STAMP_BYTES * stamped(link) for link, c in capacities.items()})

    def abandon(self) -> None:
        if hasattr(self.inner, "abandon"):
            self.inner.abandon()

    def mark_dead(self) -> None:
        if hasattr(self.inner, "mark_dead"):
            self.inner.mark_dead()


def with_link_delay(transport: Transport, delay_us: float, nodes: Sequence[int] | None = None) -> Transport:
    """`transport` with an emulated per-message latency of `delay_us` (none at 0: the default) on
    the messages to and from ranks of another node (`nodes`: each rank's node; None: every rank
    a node of its own)."""
    if delay_us <= 0:
        return transport
    remote = None if nodes is None else frozenset(r for r, n in enumerate(nodes) if n != nodes[transport.rank])
    return DelayedTransport(transport, delay_us, remote)


def rank_nodes(rank: int, world_size: int) -> list[int]:
    """Each rank's node (collective over the default group): torchrun's node rank (GROUP_RANK);
    ranks one command spawned on its own host count as a node each, so that a local run with a
    link delay stands in for one rank per node."""
    import torch.distributed as dist

    nodes = torch.zeros(world_size, dtype=torch.int64)
    nodes[rank] = int(os.environ["GROUP_RANK"]) if "GROUP_RANK" in os.environ else rank
    dist.all_reduce(nodes)
    return nodes.tolist()


def loopback_pair(inner: Transport) -> tuple[LoopbackTransport, LoopbackTransport]:
    """(driver view, stage-0 view) of one rank's transport, with a FIFO per direction."""
    to_stage, to_driver = queue.SimpleQueue(), queue.SimpleQueue()
    return LoopbackTransport(inner, to_stage, to_driver), LoopbackTransport(inner, to_driver, to_stage)

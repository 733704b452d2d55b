"""Point-to-point transport: a small interface, a torch.distributed implementation and an
in-process one (threads in one process: tests and the reference executor).

A message is a header plus zero or more payload tensors whose shapes the receiver derives
from the header, so every receive lands in a preallocated buffer. Receives inside a request
time out with an error naming (rank, peer, tick); a dead peer surfaces as the same error.
Per-link FIFO order is what the lazy rollback of docs/design.md 3.4 relies on: torch.distributed P2P
within one process group between a fixed pair of ranks and the in-process queues both preserve
it (the distributed transport uses one group per direction of each pair).
"""
from __future__ import annotations

import abc
import datetime
import queue
import threading
from collections.abc import Sequence

import torch

from spd_engine.engine.messages import HEADER_LEN, Header


class TransportError(RuntimeError):
    """A receive timed out or a peer died; the message names (rank, peer, tick)."""

    def __init__(self, rank: int, peer: int, tick: int, what: str) -> None:
        super().__init__(f"rank {rank}: {what} (rank={rank}, peer={peer}, tick={tick})")
        self.rank, self.peer, self.tick = rank, peer, tick


class Transport(abc.ABC):
    rank: int
    world_size: int

    @abc.abstractmethod
    def send(self, dst: int, header: Header, payloads: Sequence[torch.Tensor] = ()) -> None:
        """Queue a message; payloads must stay unmodified until `flush` or the next send."""

    @abc.abstractmethod
    def recv_header(self, src: int, timeout: float | None, tick: int = -1) -> Header:
        """Next header from src; timeout None waits forever (idle between requests)."""

    @abc.abstractmethod
    def recv_into(self, src: int, out: torch.Tensor, timeout: float | None, tick: int = -1) -> torch.Tensor:
        """Next payload from src, written into the contiguous buffer `out`."""

    def flush(self) -> None:
        """Wait until every queued send has left."""

    def close(self) -> None:
        self.flush()


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


class DistTransport(Transport):
    """torch.distributed isend/irecv (gloo on CPU, NCCL on GPU), one process group per direction
    of each rank pair (directional_groups). Tensors on another device than the transport's
    (small host-side payloads: sampling settings, stage statistics) are staged through its
    device, since NCCL moves only GPU memory. Collective over the default group: every rank
    constructs its transport."""

    def __init__(self, rank: int, world_size: int, device: torch.device | str = "cpu") -> None:
        self.rank, self.world_size, self.device = rank, world_size, torch.device(device)
        self._pending: list[tuple[object, torch.Tensor]] = []  # (work, tensor kept alive)
        self._hdr_in = torch.empty(HEADER_LEN, dtype=torch.int64, device=self.device)
        self._groups = directional_groups(rank, world_size)

    def send(self, dst: int, header: Header, payloads: Sequence[torch.Tensor] = ()) -> None:
        import torch.distributed as dist

        self._pending = [(w, t) for w, t in self._pending if not w.is_completed()]
        hdr = header.to_tensor().to(self.device)
        group = self._groups[(self.rank, dst)]
        try:
            self._pending.append((dist.isend(hdr, dst, group=group), hdr))
            for p in payloads:
                p = p.to(self.device).contiguous()
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

    def recv_header(self, src: int, timeout: float | None, tick: int = -1) -> Header:
        import torch.distributed as dist

        self._wait(dist.irecv(self._hdr_in, src, group=self._groups[(src, self.rank)]), src, timeout, tick)
        return Header.from_tensor(self._hdr_in.cpu())  # host sync: the header decides what to do

    def recv_into(self, src: int, out: torch.Tensor, timeout: float | None, tick: int = -1) -> torch.Tensor:
        import torch.distributed as dist

        assert out.is_contiguous()
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

    def abandon(self) -> None:
        """Forget queued sends without waiting (the run is failing; the peers may be gone), and
        drop the groups, so that destroying the process group really closes their connections
        (a peer blocked on one of them then fails at once instead of waiting for its timeout)."""
        self._pending.clear()
        self._groups.clear()


class LocalHub:
    """Shared state of in-process transports: one FIFO queue per (src, dst) link."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.links = {(s, d): queue.Queue() for s in range(world_size) for d in range(world_size)}
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

    def recv_into(self, src: int, out: torch.Tensor, timeout: float | None, tick: int = -1) -> torch.Tensor:
        if src != self.rank:
            return self.inner.recv_into(src, out, timeout, tick)
        item = self._pop(tick)
        assert isinstance(item, torch.Tensor) and item.shape == out.shape, (item, out.shape)
        return out.copy_(item)

    def flush(self) -> None:
        self.inner.flush()

    def mark_dead(self) -> None:
        if hasattr(self.inner, "mark_dead"):
            self.inner.mark_dead()


def loopback_pair(inner: Transport) -> tuple[LoopbackTransport, LoopbackTransport]:
    """(driver view, stage-0 view) of one rank's transport, with a FIFO per direction."""
    to_stage, to_driver = queue.SimpleQueue(), queue.SimpleQueue()
    return LoopbackTransport(inner, to_stage, to_driver), LoopbackTransport(inner, to_driver, to_stage)

"""The collectives of one stage's tensor-parallel group: all_gather of small tensors, and the
all-reduce built on it. Three implementations: one rank (no-op), ranks as threads of one process
(the reference executor), and a torch.distributed subgroup (gloo / NCCL).

The all-reduce is an all_gather followed by a sum in TP-rank order on every rank (`reduce_parts`),
not a library all-reduce: the library may add the pieces in another order on each rank and per
algorithm, so the sum would differ in its last bits between ranks, between threads and processes,
and from the serial reference (engine/model/tp_model.py `SerialTP`). A fixed order makes all of them
bit-identical (docs/design.md 3.9). The pieces are one token's hidden states on the decode path,
so gathering T of them costs the same round trips as a ring all-reduce of that size.
"""
from __future__ import annotations

import abc
import datetime
import threading
import time
from collections.abc import Sequence

import torch

from spd_engine.engine.comm.transport import TransportError, hold_until


def reduce_parts(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """Sum of the TP ranks' partial results, added in rank order (the one order everywhere)."""
    acc = parts[0].clone()
    for p in parts[1:]:
        acc += p
    return acc


class TPGroup(abc.ABC):
    """One rank's view of its stage's TP group: `rank` of `size`, the global ranks `members`."""

    rank: int
    size: int
    members: tuple[int, ...]
    calls: int = 0  # collectives made so far (a stage worker reads the decode ones' share)
    collective_s: float = 0.0  # seconds inside them: the transfer and the wait for slower peers
    # an emulated link latency (RunConfig.parallel.link_delay_us): a gather over T ranks ends (T - 1) link
    # latencies after the last rank's part arrived, as a ring's T - 1 steps would on that link
    link_delay_ns: int = 0

    @property
    def peer(self) -> int:
        """The global rank a failed collective is blamed on: the other member of a pair, else -1
        (a collective does not say which of several peers left; the message lists the group)."""
        return self.members[1 - self.rank] if self.size == 2 else -1

    def all_gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Every TP rank's `x` (same shape and dtype on all), in TP-rank order; counted and timed."""
        t0 = time.perf_counter()
        out = self._gather(x)
        if self.link_delay_ns:
            hold_until(time.time_ns() + (self.size - 1) * self.link_delay_ns)
        self.calls += 1
        self.collective_s += time.perf_counter() - t0
        return out

    @abc.abstractmethod
    def _gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        """all_gather's communication."""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over the group of `x`, bit-identical on every rank (reduce_parts order)."""
        return reduce_parts(self.all_gather(x))

    def abort(self) -> None:
        """This rank is failing: make the peers' pending and later collectives fail at once."""


class SoloGroup(TPGroup):
    """tp = 1: no communication."""

    def __init__(self, member: int = 0) -> None:
        self.rank, self.size, self.members = 0, 1, (member,)

    def _gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        return [x]

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x


class LocalTPHub:
    """Shared state of one stage's TP ranks running as threads: a slot per rank and a barrier."""

    def __init__(self, members: Sequence[int], timeout_s: float) -> None:
        self.members, self.timeout_s = tuple(members), timeout_s
        self.slots: list[torch.Tensor | None] = [None] * len(members)
        self.barrier = threading.Barrier(len(members))

    def group(self, tp_rank: int) -> "LocalTPGroup":
        return LocalTPGroup(self, tp_rank)


class LocalTPGroup(TPGroup):
    def __init__(self, hub: LocalTPHub, tp_rank: int) -> None:
        self.hub, self.rank, self.size, self.members = hub, tp_rank, len(hub.members), hub.members

    def _wait(self) -> None:
        try:
            self.hub.barrier.wait(self.hub.timeout_s)
        except threading.BrokenBarrierError:
            raise TransportError(self.members[self.rank], self.peer, -1,
                                 f"TP collective over ranks {list(self.members)} failed: a TP peer died or "
                                 f"timed out after {self.hub.timeout_s}s") from None

    def _gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        self.hub.slots[self.rank] = x.detach().clone()
        self._wait()  # every slot written
        out = [s.clone() for s in self.hub.slots]
        self._wait()  # every slot read before any rank writes the next one
        return out

    def abort(self) -> None:
        self.hub.barrier.abort()


class DistTPGroup(TPGroup):
    """A torch.distributed subgroup; every wait is bounded by the request timeout, and a failure
    names this rank and the group's ranks."""

    def __init__(self, group, members: Sequence[int], global_rank: int, timeout_s: float) -> None:
        self.group, self.members, self.timeout_s = group, tuple(members), timeout_s
        self.rank, self.size, self.global_rank = self.members.index(global_rank), len(members), global_rank

    def _gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        import torch.distributed as dist

        x = x.contiguous()
        out = [torch.empty_like(x) for _ in range(self.size)]
        try:
            work = dist.all_gather(out, x, group=self.group, async_op=True)
            work.wait(timeout=datetime.timedelta(seconds=self.timeout_s))
        except RuntimeError as err:
            raise TransportError(self.global_rank, self.peer, -1, f"TP collective over ranks {list(self.members)} "
                                 f"failed or timed out after {self.timeout_s}s: {err}") from err
        return out


def dist_tp_groups(topo, global_rank: int, timeout_s: float, link_delay_us: float = 0.0,
                   nodes: Sequence[int] | None = None) -> TPGroup:
    """This rank's TP group; its collectives pay `link_delay_us` per step when the group spans
    nodes (`nodes`: each rank's node; None: every rank a node of its own). `new_group` is
    collective over the default group: every rank creates every stage's group, in stage order,
    and keeps its own."""
    import torch.distributed as dist

    mine: TPGroup = SoloGroup(global_rank)
    if topo.tp == 1:
        return mine
    for stage in range(topo.n):
        members = topo.stage_ranks(stage)
        group = dist.new_group(list(members))
        if global_rank in members:
            mine = DistTPGroup(group, members, global_rank, timeout_s)
            spans = nodes is None or len({nodes[m] for m in members}) > 1
            mine.link_delay_ns = round(link_delay_us * 1e3) if spans else 0
    return mine

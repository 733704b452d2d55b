"""The emulated link latency (engine/comm/transport.py DelayedTransport, RunConfig.parallel.link_delay_us):
a message is delivered `delay` after it was sent, not after it was read (a message that waited in
the queue pays only what is left), payloads and order are untouched, frames grow by the stamp, a
TP gather pays (T - 1) delays; between real processes over the gloo frames and the shared-memory
rings, a ping-pong's one-way time grows by the delay."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from spd_engine.engine.comm.dist import LocalRanks, join_group, local_init_method
from spd_engine.engine.comm.tp_group import LocalTPHub
from spd_engine.engine.comm.transport import (
    DelayedTransport,
    DistTransport,
    LocalHub,
    LocalTransport,
    Transport,
    hold_until,
    with_link_delay,
)
from spd_engine.engine.protocol.messages import Header, Kind

DELAY_US = 20_000.0  # 20 ms: far above a thread switch on a loaded host, so the bounds below hold


def _pair(delay_us: float) -> tuple[Transport, Transport]:
    hub = LocalHub(2)
    return with_link_delay(hub.transport(0), delay_us), with_link_delay(hub.transport(1), delay_us)


@pytest.mark.pure
def test_no_delay_is_the_plain_transport():
    hub = LocalHub(2)
    t = hub.transport(0)
    assert with_link_delay(t, 0.0) is t and isinstance(with_link_delay(t, 5.0), DelayedTransport)


@pytest.mark.pure
def test_a_message_is_delivered_the_delay_after_it_was_sent_intact_and_in_order():
    a, b = _pair(DELAY_US)
    t0 = time.perf_counter()
    for i in range(3):
        a.send(1, Header(Kind.TOKEN, i, 0), [torch.full((4,), float(i)), torch.arange(i + 1)])
    sent = time.perf_counter() - t0
    out = torch.empty(4)
    for i in range(3):
        assert b.recv_header(0, 5.0).position == i
        assert torch.equal(b.recv_into(0, out, 5.0), torch.full((4,), float(i)))
        assert torch.equal(b.recv_into(0, torch.empty(i + 1, dtype=torch.int64), 5.0), torch.arange(i + 1))
    took = time.perf_counter() - t0
    assert sent < DELAY_US / 1e6 / 2  # the sender did not wait
    # three messages sent together arrive together: one delay, not three
    assert DELAY_US / 1e6 <= took < 2 * DELAY_US / 1e6, took


@pytest.mark.pure
def test_a_message_that_waited_pays_only_what_is_left_of_the_delay():
    a, b = _pair(DELAY_US)
    a.send(1, Header(Kind.END, 0, 0))
    time.sleep(2 * DELAY_US / 1e6)  # the receiver computes meanwhile
    t0 = time.perf_counter()
    b.recv_header(0, 5.0)
    assert time.perf_counter() - t0 < DELAY_US / 1e6 / 2


@pytest.mark.pure
def test_frames_grow_by_the_stamp():
    class Frames(LocalTransport):
        def set_frames(self, capacities):
            self.caps = capacities

    inner = Frames(LocalHub(2), 0)
    DelayedTransport(inner, 10.0).set_frames({(0, 1): 100, (1, 0): 0})
    assert inner.caps == {(0, 1): 100 + DelayedTransport.STAMP_BYTES, (1, 0): DelayedTransport.STAMP_BYTES}


@pytest.mark.pure
def test_hold_until_returns_at_the_time_asked():
    due = time.time_ns() + 5_000_000
    hold_until(due)
    assert time.time_ns() >= due
    t0 = time.perf_counter()
    hold_until(time.time_ns() - 1)  # already due: at once
    assert time.perf_counter() - t0 < 1e-3


@pytest.mark.pure
def test_a_tp_gather_pays_a_delay_per_ring_step():
    hub = LocalTPHub((0, 1, 2), timeout_s=5.0)
    groups = [hub.group(r) for r in range(3)]
    for g in groups:
        g.link_delay_ns = round(DELAY_US * 1e3)
    took = {}

    def gather(g):
        t0 = time.perf_counter()
        assert [int(x) for x in g.all_reduce(torch.tensor([g.rank + 1]))] == [6]
        took[g.rank] = time.perf_counter() - t0

    threads = [threading.Thread(target=gather, args=(g,)) for g in groups]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert all(2 * DELAY_US / 1e6 <= s < 4 * DELAY_US / 1e6 for s in took.values()), took
    assert all(g.collective_s >= 2 * DELAY_US / 1e6 for g in groups)  # counted as communication


def _pingpong(rank: int, init_method: str, kind: str, delay_us: float) -> float | None:
    """Median one-way time (s) of 20 round trips of a header + 64 floats; rank 0 returns it."""
    from statistics import median

    from spd_engine.engine.comm.shm_transport import ShmTransport

    join_group(rank, 2, "gloo", "cpu", init_method, timeout_s=30.0)
    inner = ShmTransport(rank, 2) if kind == "shm" else DistTransport(rank, 2)
    t = with_link_delay(inner, delay_us)
    t.set_frames({(0, 1): 256, (1, 0): 256})
    buf, peer, rtts = torch.zeros(64), 1 - rank, []
    for i in range(23):
        t0 = time.perf_counter()
        if rank == 0:
            t.send(peer, Header(Kind.TOKEN, i, 0), [buf])
        t.recv_header(peer, 10.0, i)
        t.recv_into(peer, buf, 10.0, i)
        if rank == 1:
            t.send(peer, Header(Kind.TOKEN, i, 0), [buf])
        rtts.append(time.perf_counter() - t0)
    t.flush()
    return median(rtts[3:]) / 2 if rank == 0 else None


@pytest.mark.multiproc
@pytest.mark.parametrize("kind", ["gloo", "shm"])
def test_between_processes_a_hop_takes_the_delay_longer(kind):
    got = {}
    for delay_us in (0.0, DELAY_US):
        with LocalRanks(_pingpong, range(2), (local_init_method(), kind, delay_us)) as ranks:
            ranks.join(120)
            assert not ranks.failed(), ranks.failure_report()
            got[delay_us] = ranks.result(0)
    added = got[DELAY_US] - got[0.0]
    assert 0.9 * DELAY_US / 1e6 <= added <= 1.5 * DELAY_US / 1e6, got


@pytest.mark.pure
def test_only_messages_between_nodes_are_delayed():
    hub = LocalHub(3)
    nodes = [0, 0, 1]  # ranks 0 and 1 share a node
    t = [with_link_delay(hub.transport(r), DELAY_US, nodes) for r in range(3)]
    assert t[0].remote == {2} and t[2].remote == {0, 1}
    t0 = time.perf_counter()
    t[0].send(1, Header(Kind.END, 1, 0))
    t[1].recv_header(0, 5.0)
    assert time.perf_counter() - t0 < DELAY_US / 1e6 / 2  # inside a node: at once
    t[0].send(2, Header(Kind.END, 2, 0))
    assert t[2].recv_header(0, 5.0).position == 2
    assert time.perf_counter() - t0 >= DELAY_US / 1e6  # across the link: the delay

"""engine/comm/transport.py's in-process transports: LocalHub / LocalTransport (the reference executor's
ranks as threads) and LoopbackTransport (a co-located driver and stage 0 on one rank).

What the runtime relies on: FIFO order per link (the lazy rollback of docs/design.md 3.4),
headers and payloads that arrive intact and are copied at send time, receives that time out
with a TransportError naming (rank, peer, tick), and a dead peer reported as an error rather
than a hang. Headers are built from kind, position and epoch only (positional).
"""
from __future__ import annotations

import threading
import time

import pytest
import torch

from spd_engine.engine.comm.transport import LocalHub, LoopbackTransport, TransportError, loopback_pair
from spd_engine.engine.protocol.messages import Header, Kind


def token(position: int, epoch: int = 0) -> Header:
    return Header(Kind.TOKEN, position, epoch)


def test_headers_and_payloads_arrive_intact_and_in_order_per_link():
    hub = LocalHub(3)
    t0, t1, t2 = (hub.transport(r) for r in range(3))
    sent = {0: [], 2: []}
    for pos in range(5):  # two senders interleaved on two links into rank 1
        for src, t in ((0, t0), (2, t2)):
            payloads = [torch.full((2, 3), float(10 * src + pos)), torch.arange(pos + 1, dtype=torch.int64)]
            t.send(1, token(pos, epoch=src), payloads)
            sent[src].append((token(pos, epoch=src), payloads))
    for src in (2, 0):  # reading one link first does not reorder the other
        for hdr, payloads in sent[src]:
            assert t1.recv_header(src, timeout=1.0) == hdr
            for p in payloads:
                out = torch.empty_like(p)
                assert t1.recv_into(src, out, timeout=1.0) is out  # written into the caller's buffer
                assert torch.equal(out, p) and out.dtype == p.dtype


def test_payloads_are_copied_at_send_time():
    hub = LocalHub(2)
    a, b = hub.transport(0), hub.transport(1)
    x = torch.ones(4)
    a.send(1, token(3), [x])
    x.fill_(-1)  # the sender reuses its buffer right away
    b.recv_header(0, timeout=1.0)
    assert torch.equal(b.recv_into(0, torch.empty(4), timeout=1.0), torch.ones(4))


def test_a_receive_across_threads_waits_for_the_message():
    hub = LocalHub(2)
    a, b = hub.transport(0), hub.transport(1)
    sender = threading.Thread(target=lambda: (time.sleep(0.2), a.send(1, token(7, 2), [torch.arange(3.0)])))
    sender.start()
    assert b.recv_header(0, timeout=None) == token(7, 2)  # None: waits as long as it takes (idle)
    assert torch.equal(b.recv_into(0, torch.empty(3), timeout=1.0), torch.arange(3.0))
    sender.join()


def test_a_receive_times_out_naming_rank_peer_and_tick():
    hub = LocalHub(3)
    t2 = hub.transport(2)
    start = time.monotonic()
    with pytest.raises(TransportError, match=r"timed out after 0.2s \(rank=2, peer=1, tick=17\)") as err:
        t2.recv_header(1, timeout=0.2, tick=17)
    assert 0.15 <= time.monotonic() - start < 5.0
    assert (err.value.rank, err.value.peer, err.value.tick) == (2, 1, 17)
    with pytest.raises(TransportError, match="tick=4"):  # a payload receive too
        t2.recv_into(0, torch.empty(1), timeout=0.1, tick=4)


def test_a_payload_of_another_shape_is_an_error():
    hub = LocalHub(2)
    a, b = hub.transport(0), hub.transport(1)
    a.send(1, token(0), [torch.zeros(2, 3)])
    b.recv_header(0, timeout=1.0)
    with pytest.raises(TransportError, match=r"payload shape \(2, 3\) != expected \(3, 2\)"):
        b.recv_into(0, torch.empty(3, 2), timeout=1.0, tick=5)


def test_a_dead_peer_is_reported_after_what_it_sent():
    hub = LocalHub(2)
    a, b = hub.transport(0), hub.transport(1)
    a.send(1, token(1))
    a.mark_dead()
    assert b.recv_header(0, timeout=5.0) == token(1)  # sent before it died: still delivered
    start = time.monotonic()
    with pytest.raises(TransportError, match=r"peer is dead \(rank=1, peer=0, tick=9\)"):
        b.recv_header(0, timeout=30.0, tick=9)  # not a 30 s wait
    assert time.monotonic() - start < 5.0
    with pytest.raises(TransportError, match="send failed: peer is dead"):
        b.send(0, token(2))


def test_loopback_carries_self_messages_and_forwards_the_rest():
    """Co-located: the driver (rank 0) and stage 0 (rank 0) talk through two FIFOs; messages to
    other ranks go through the rank's own transport."""
    hub = LocalHub(2)
    driver, stage = loopback_pair(hub.transport(0))
    other = hub.transport(1)
    assert isinstance(driver, LoopbackTransport) and driver.rank == stage.rank == 0 and driver.world_size == 2
    for pos in range(3):
        driver.send(0, token(pos), [torch.full((2,), float(pos))])
    for pos in range(3):  # FIFO, intact
        assert stage.recv_header(0, timeout=None) == token(pos)
        assert torch.equal(stage.recv_into(0, torch.empty(2), timeout=None), torch.full((2,), float(pos)))
    x = torch.ones(2)
    stage.send(0, token(9, 1), [x])  # the other direction, copied at send time
    x.zero_()
    assert driver.recv_header(0, timeout=None) == token(9, 1)
    assert torch.equal(driver.recv_into(0, torch.empty(2), timeout=None), torch.ones(2))
    stage.send(1, token(4), [torch.arange(2.0)])  # stage 0 -> stage 1 over the hub
    assert other.recv_header(0, timeout=1.0) == token(4)
    assert torch.equal(other.recv_into(0, torch.empty(2), timeout=1.0), torch.arange(2.0))
    other.send(0, token(5))
    assert driver.recv_header(1, timeout=1.0) == token(5)
    with pytest.raises(TransportError, match="tick=3"):  # timeouts of forwarded receives still name the tick
        stage.recv_header(1, timeout=0.1, tick=3)


def test_loopback_self_receive_with_nothing_queued_is_a_bug_not_a_wait():
    driver, stage = loopback_pair(LocalHub(1).transport(0))
    with pytest.raises(AssertionError, match="nothing queued"):
        stage.recv_header(0, timeout=None, tick=6)


def test_loopback_mark_dead_reaches_the_peers():
    hub = LocalHub(2)
    driver, _ = loopback_pair(hub.transport(0))
    driver.mark_dead()
    with pytest.raises(TransportError, match="peer is dead"):
        hub.transport(1).recv_header(0, timeout=5.0)


def test_ready_says_whether_a_message_has_arrived():
    hub = LocalHub(2)
    a, b = hub.transport(0), hub.transport(1)
    assert not b.ready(0)
    a.send(1, token(1), [torch.ones(2)])
    assert b.ready(0) and not a.ready(1)
    b.recv_header(0, timeout=1.0)
    b.recv_into(0, torch.empty(2), timeout=1.0)
    assert not b.ready(0)
    driver, stage = loopback_pair(hub.transport(0))
    assert not stage.ready(0)
    driver.send(0, token(2))  # to itself: the co-located stage 0's queue
    assert stage.ready(0) and not driver.ready(0)

"""The shared-memory transport (engine/comm/shm_transport.py) between real processes: headers and
payloads intact and in order (payloads larger than a ring stream through it), two ranks that
send to each other before receiving do not deadlock, a receive times out naming (rank, peer,
tick), a dead or abandoning peer ends a wait at once, nothing is left in /dev/shm; the runtime
over it equals greedy decoding, with the gloo transport beside it; the ring's own arithmetic."""
from __future__ import annotations

import glob
import os
import time

import numpy as np
import pytest
import torch

from spd_engine.engine.comm.dist import LocalRanks, join_group, local_init_method
from spd_engine.engine.comm.shm_transport import RING_BYTES, ShmTransport, TransportError, _Ring
from spd_engine.engine.protocol.messages import HEADER_LEN, Header, Kind

pytestmark = pytest.mark.multiproc

BIG = RING_BYTES // 4 * 3 + 17  # float32 elements: 3 rings' worth and an odd tail


def _transport(rank: int, init_method: str, timeout_s: float = 30.0) -> ShmTransport:
    join_group(rank, 2, "gloo", "cpu", init_method, timeout_s=timeout_s)
    return ShmTransport(rank, 2)


def _exchange(rank: int, init_method: str) -> dict | None:
    """Both ranks send many messages (small and ring-sized) before receiving any; rank 0 checks."""
    t = _transport(rank, init_method)
    peer = 1 - rank
    for i in range(50):  # headers keep large integers exact
        t.send(peer, Header(Kind.TOKEN, i, 2 ** 40 + i, token=rank * 1000 + i), [torch.full((576,), float(i))])
    big = torch.arange(BIG, dtype=torch.float32) * (rank + 1)
    t.send(peer, Header(Kind.PREFILL, 0, 1, length=BIG), [big, big[:5]])
    got = []
    buf = torch.empty(576)
    deadline = time.monotonic() + 10.0
    while not t.ready(peer) and time.monotonic() < deadline:  # the peer's first message is coming
        time.sleep(0.001)
    arrived = t.ready(peer)
    for i in range(50):
        h = t.recv_header(peer, 10.0, i)
        t.recv_into(peer, buf, 10.0, i)
        got.append((h.kind, h.position, h.epoch, h.token, bool((buf == i).all())))
    h = t.recv_header(peer, 10.0)
    a, b = torch.empty(BIG), torch.empty(5)
    t.recv_into(peer, a, 10.0)
    t.recv_into(peer, b, 10.0)
    t.flush()
    want = torch.arange(BIG, dtype=torch.float32) * (peer + 1)
    return {"got": got, "big": bool(torch.equal(a, want) and torch.equal(b, want[:5])), "len": h.length,
            "ready": (arrived, t.ready(peer))} if rank == 0 else None


def test_messages_arrive_intact_in_order_and_crossed_sends_do_not_deadlock():
    leftover = set(glob.glob("/dev/shm/spd-*"))
    with LocalRanks(_exchange, range(2), (local_init_method(),)) as ranks:
        ranks.join(120)
        assert not ranks.failed(), ranks.failure_report()
        res = ranks.result(0)
    assert [tuple(g) for g in res["got"]] == [(Kind.TOKEN, i, 2 ** 40 + i, 1000 + i, True) for i in range(50)]
    assert res["big"] and res["len"] == BIG
    assert res["ready"] == [True, False]  # a message waiting, then none left
    assert set(glob.glob("/dev/shm/spd-*")) <= leftover  # unlinked once mapped


def _timeout(rank: int, init_method: str) -> dict | None:
    t = _transport(rank, init_method)
    if rank == 1:
        time.sleep(3.0)  # alive, silent
        return None
    t0 = time.monotonic()
    try:
        t.recv_header(1, 0.5, tick=7)
    except TransportError as err:
        return {"error": str(err), "waited": time.monotonic() - t0}
    return {"error": None}


def test_a_receive_times_out_naming_rank_peer_and_tick():
    with LocalRanks(_timeout, range(2), (local_init_method(),)) as ranks:
        ranks.join(60)
        res = ranks.result(0)
    assert "timed out after 0.5s" in res["error"] and "(rank=0, peer=1, tick=7)" in res["error"]
    assert 0.5 <= res["waited"] < 2.0


def _dead(rank: int, init_method: str, how: str) -> dict | None:
    t = _transport(rank, init_method)
    if rank == 1:
        t.send(0, Header(Kind.TOKEN, 3, 1))
        t.flush()
        if how == "abandon":
            t.abandon()
            time.sleep(5.0)  # still alive: the flag alone must end the peer's wait
        os._exit(4)
    first = t.recv_header(1, 30.0)  # what it sent before dying still arrives
    t0 = time.monotonic()
    try:
        t.recv_header(1, 30.0 if how == "abandon" else None, tick=9)  # None: an idle wait between requests
    except TransportError as err:
        return {"first": first.position, "error": str(err), "waited": time.monotonic() - t0}
    return {"error": None}


@pytest.mark.parametrize("how", ["exit", "abandon"])
def test_a_dead_or_abandoning_peer_ends_a_wait_at_once(how):
    with LocalRanks(_dead, range(2), (local_init_method(), how)) as ranks:
        ranks.join(60)
        res = ranks.result(0)
    assert res["first"] == 3 and "peer failed" in res["error"] and "peer=1" in res["error"]
    assert res["waited"] < 2.0  # not the 30 s timeout


def test_ring_wraps_and_counts_bytes(tmp_path):
    path = str(tmp_path / "ring")
    w, r = _Ring(path, create=True), _Ring(path, create=False)
    data = np.arange(RING_BYTES + 1000, dtype=np.int64).astype(np.uint8)
    assert w.write_some(data) == RING_BYTES  # full: the rest waits
    out = np.zeros(700, dtype=np.uint8)
    assert r.read_some(out) == 700 and (out == data[:700]).all()
    assert w.write_some(data[RING_BYTES:]) == 700  # wraps around the end
    rest = np.zeros(RING_BYTES + 300, dtype=np.uint8)
    assert r.read_some(rest) == RING_BYTES and (rest[:RING_BYTES] == data[700:RING_BYTES + 700]).all()
    assert r.read_some(rest) == 0


def test_ring_writes_a_message_in_parts_across_the_wrap_and_returns_what_did_not_fit(tmp_path):
    path = str(tmp_path / "ring")
    w, r = _Ring(path, create=True), _Ring(path, create=False)
    filler = np.full(RING_BYTES - 50, 7, dtype=np.uint8)
    assert w.write_parts([filler]) == []
    assert r.read_some(np.zeros(RING_BYTES - 60, dtype=np.uint8)) == RING_BYTES - 60  # 10 bytes left unread
    head, body = np.arange(72, dtype=np.uint8), np.arange(RING_BYTES, dtype=np.int64).astype(np.uint8)
    tail = np.arange(5, dtype=np.uint8)
    left = w.write_parts([head, body, tail])  # the head wraps; the body fits only in part
    free = RING_BYTES - 10
    assert len(left) == 2 and left[0].size == 72 + RING_BYTES - free and (left[1] == tail).all()
    assert (left[0] == body[free - 72:]).all()
    assert int(w.ctrl[0]) == RING_BYTES - 50 + free  # one published count for everything written
    out = np.zeros(free + 10, dtype=np.uint8)
    assert r.read_some(out) == free + 10
    assert (out[:10] == 7).all() and (out[10:82] == head).all() and (out[82:] == body[:free - 72]).all()

def test_ring_fast_path_whole_messages_only_and_interleaves_with_the_general_path(tmp_path):
    """write_message / read_header / read_view (a decode tick's struct + memoryview path) take a
    message only whole and unwrapped, else touch nothing, so the general path carries it instead;
    a reader may mix both paths on one message."""
    path = str(tmp_path / "ring")
    w, r = _Ring(path, create=True), _Ring(path, create=False)
    hdr = Header(Kind.TOKEN, 5, 2 ** 40 + 3, token=7)
    payload = torch.arange(576, dtype=torch.float32)  # [576] as a tick's hidden row
    view = memoryview(payload.numpy().view(np.uint8))
    into = torch.empty(576)
    into_view = memoryview(into.numpy().view(np.uint8))
    msg = 8 * HEADER_LEN + view.nbytes
    sent = 0
    while sent + msg <= RING_BYTES:  # fill the ring up to its end with fast-path messages
        assert w.write_message(hdr._replace(position=sent), [view])
        sent += msg
    assert not w.write_message(hdr, [view])  # it would wrap (and does not fit yet): nothing written
    assert int(w.ctrl[0]) == sent
    first = r.read_header()
    assert Header.from_ints(first) == hdr._replace(position=0)
    assert r.read_view(into_view) and torch.equal(into, payload)
    for _ in range(sent // msg - 1):  # drain the rest
        assert r.read_header() is not None and r.read_view(into_view)
    assert r.read_header() is None  # nothing there
    # the next message crosses the ring's end: the general path writes it, the fast reads refuse it
    assert 8 * HEADER_LEN <= RING_BYTES - sent < msg  # the header fits before the end, the payload does not
    ints = np.array(hdr.to_ints(), dtype=np.int64).view(np.uint8)
    assert w.write_parts([ints, payload.numpy().view(np.uint8)]) == []
    assert Header.from_ints(r.read_header()) == hdr
    assert not r.read_view(into_view)  # the payload wraps
    into.zero_()
    assert r.read_some(into.numpy().view(np.uint8)) == view.nbytes and torch.equal(into, payload)
    assert w.write_message(hdr, [view]) and r.read_header() is not None and r.read_view(into_view)
    assert r.available() == 0


def _tick_stream(rank: int, init_method: str, iters: int) -> str:
    """A decode tick's traffic at full speed: a pinned [1, H] row one way, anchors and exit back,
    now and then a prefill chunk that wraps the ring and queues; every value checked."""
    t = _transport(rank, init_method, timeout_s=10.0)
    row, row_in = torch.empty(1, 576), torch.empty(1, 576)
    anchors, anchors_in = torch.empty(1, 2, 576), torch.empty(1, 2, 576)
    for buf in (row, row_in, anchors, anchors_in):
        t.pin(buf)
    chunk = torch.empty(500, 576)  # 1.1 MB: several rings
    for i in range(iters):
        if rank == 0:
            t.send(1, Header(Kind.TOKEN, i, 1, token=i), [row.fill_(i)])
            if i % 97 == 0:
                t.send(1, Header(Kind.PREFILL, i, 1, length=500), [chunk.fill_(i)])
            hdr = t.recv_header(1, 10.0, i)
            t.recv_into(1, anchors_in, 10.0, i)
            t.recv_into(1, row_in, 10.0, i)
            assert hdr.position == i and float(row_in[0, 0]) == i + 0.5 and float(anchors_in[0, 1, 5]) == -i
        else:
            hdr = t.recv_header(0, 10.0, i)
            t.recv_into(0, row_in, 10.0, i)
            assert hdr.position == i and hdr.token == i and float(row_in[0, 7]) == i
            if i % 97 == 0:
                assert t.recv_header(0, 10.0, i).kind == Kind.PREFILL
                assert float(t.recv_into(0, chunk, 10.0, i)[499, 3]) == i
            t.send(0, Header(Kind.TOKEN, i, 1), [anchors.fill_(-i), row.fill_(i + 0.5)])
    t.flush()
    return "ok"


def test_a_long_tick_stream_keeps_every_message_and_count_intact():
    """Tens of thousands of fast-path messages, mixed with chunks that wrap the ring and queue, all
    arrive intact and in order. (A count read half-written, which struct's standard-size "<q" made
    possible, hung a 300k-message run of this traffic within 15k-75k messages; at this length the
    test does not catch it reliably, so it claims only the stream's integrity.)"""
    messages = int(os.environ.get("SPD_SHM_STREAM_MESSAGES", "40000"))  # longer runs: set it higher
    with LocalRanks(_tick_stream, range(2), (local_init_method(), messages)) as ranks:
        ranks.join(120 + messages / 1000)
        assert ranks.result(0) == "ok"


def test_run_config_refuses_shm_off_cpu():
    from spd_engine.engine.model.model_config import tiny_config
    from spd_engine.engine.protocol.topology import Topology
    from spd_engine.engine.runtime.run_config import ModelSpec, ParallelLayout, RunConfig

    cfg = tiny_config()
    topo = Topology.build(cfg.num_layers, n=2)
    with pytest.raises(ValueError, match="transport shm .* --device cpu and the gloo backend"):
        RunConfig(model=ModelSpec(source="random:tiny-llama", cfg=cfg),
                  parallel=ParallelLayout(topology=topo, transport="shm", backend="nccl"))
    with pytest.raises(ValueError, match="transport must be one of"):
        RunConfig(model=ModelSpec(source="random:tiny-llama", cfg=cfg),
                  parallel=ParallelLayout(topology=topo, transport="tcp"))


@pytest.mark.parametrize("transport,colocate", [("shm", False), ("shm", True), ("gloo", True)])
def test_runtime_over_each_transport_equals_greedy(transport, colocate):
    from helpers import CHUNK, random_prompts, reference, tiny_engine_config

    from spd_engine.engine.runtime.launch import launch

    ecfg = tiny_engine_config("llama", 3, colocate, threads=1, transport=transport)
    prompts = random_prompts(ecfg.model.cfg, (1, 2 * CHUNK + 5, 9), seed=2)
    with launch(ecfg) as runtime:
        got = [runtime.generate(p, 24).tokens for p in prompts]
    assert got == [reference(ecfg, p, 24) for p in prompts]

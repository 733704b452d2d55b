"""A stage's one-row decode messages over a transport that pins buffers (the shared-memory rings,
engine/comm/shm_transport.py): an eager step's layers write the output row and the anchors straight
into the pinned rows, so nothing is copied or allocated to send them, and the bytes that leave
equal the wire format's computed the plain way (anchors ascending, then the exit; the row that
goes downstream), tick after tick. A recording transport stands in for the rings: like them it
keeps a message's payloads as one byte stream."""
from __future__ import annotations

from collections import deque

import pytest
import torch
from helpers import tiny_engine_config

from spd_engine.engine.comm.transport import Transport
from spd_engine.engine.protocol.messages import Header, Kind
from spd_engine.engine.runtime.build import build_stage_model
from spd_engine.engine.runtime.stage_worker import StageWorker


class Recording(Transport):
    """Delivers queued input messages and records what is sent: (dst, header, payload objects,
    their bytes joined)."""

    pins_buffers = True

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size
        self.inbox: deque = deque()
        self.sent: list[tuple[int, Header, list[torch.Tensor], bytes]] = []
        self.pinned: set[int] = set()

    def send(self, dst, header, payloads=()):
        stream = b"".join(p.contiguous().numpy().tobytes() for p in payloads)  # copied now, as the rings do
        self.sent.append((dst, header, list(payloads), stream))

    def recv_header(self, src, timeout, tick=-1):
        return self.inbox.popleft()

    def recv_into(self, src, out, timeout, tick=-1):
        return out.copy_(self.inbox.popleft())

    def pin(self, t):
        self.pinned.add(id(t))


def _copies_into(rows: list[torch.Tensor], monkeypatch) -> list[int]:
    """Counts Tensor.copy_ calls whose destination shares storage with one of `rows`."""
    ptrs = {r.untyped_storage().data_ptr() for r in rows}
    count = [0]
    copy = torch.Tensor.copy_

    def counted(self, src, *a, **k):
        count[0] += self.untyped_storage().data_ptr() in ptrs
        return copy(self, src, *a, **k)

    monkeypatch.setattr(torch.Tensor, "copy_", counted)
    return count


def _worker(stage: int, step_mode: str):
    ecfg = tiny_engine_config("llama", 2, colocate=False, verify_at="last", anchors=(0, 3, 5), step_mode=step_mode)
    topo, plan = ecfg.parallel.topology, ecfg.plan()
    model = build_stage_model(ecfg, topo.layers_of(stage), embedding=stage == 0, head=stage == topo.n - 1)
    t = Recording(topo.stage_rank(stage), ecfg.world_size)
    return ecfg, plan, model, t, StageWorker(stage, topo, plan, model, t, ecfg.rank_options(stage))


@pytest.mark.parametrize("step_mode", ["eager", "static"])
@pytest.mark.parametrize("stage", [0, 1])
def test_decode_rows_leave_from_the_pinned_buffers_with_the_plain_bytes(stage, step_mode, monkeypatch):
    """Stage 0's anchor (layer 2) is its output, so its anchor row is the row it sends
    downstream; the last stage reports an anchor (layer 4 of 3..5) and its exit."""
    ecfg, plan, model, t, worker = _worker(stage, step_mode)
    layers = [plan.anchor_layer(a) for a in plan.anchors_of_stage(stage)]
    assert layers == ([2] if stage == 0 else [4])
    shared = worker.out1.data_ptr() == worker.anchors1[0, -1].data_ptr()
    assert shared == (stage == 0)  # one row serves as both
    pinned_rows = [worker.out1, worker.anchors1]
    assert {id(p) for p in pinned_rows + worker._report1} <= t.pinned
    copies = _copies_into(pinned_rows, monkeypatch)
    g = torch.Generator().manual_seed(5)
    H = ecfg.model.cfg.hidden_size
    ref_cache = model.new_cache(1, ecfg.runtime.capacity)
    for pos in range(3):  # a few ticks: the same pinned rows carry each tick's values
        h = torch.randn(1, H, generator=g)
        token = pos + 7
        t.inbox.append(Header(Kind.TOKEN, position=pos, epoch=1, token=token))
        if stage > 0:
            t.inbox.append(h)
        t.sent.clear()
        assert worker.step()
        x = model.embed(torch.tensor([[token]])) if stage == 0 else h[None]
        with torch.no_grad():
            out, caps = model.forward_layers(x, ref_cache, pos, capture=frozenset(layers))
        report = [m for m in t.sent if m[0] == ecfg.parallel.topology.driver_rank]
        assert len(report) == 1
        _, hdr, payloads, stream = report[0]
        want = torch.cat([caps[layer][0] for layer in layers] + ([out[0]] if stage == 1 else []))
        got = torch.frombuffer(bytearray(stream), dtype=torch.float32).view_as(want)
        if step_mode == "eager":  # the same operations: bit-identical
            assert torch.equal(got, want)
        else:  # a static step attends over its length bucket: equal up to summation order (rows
            # out of order or from another tick would differ by the values themselves, ~1e-2)
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
        assert all(p is r for p, r in zip(payloads, worker._report1)) and len(payloads) == len(worker._report1)
        if stage == 0:
            (dst, _, down, down_stream), = [m for m in t.sent if m[0] != ecfg.parallel.topology.driver_rank]
            assert dst == ecfg.parallel.topology.stage_rank(1) and down[0] is worker.out1
            assert down_stream == stream  # the anchor is the output: the same bytes
        else:  # a verifying last stage answers BATCH rows' argmaxes in their table, never a TOKEN header
            assert hdr.reply == -1
    assert (copies[0] == 0) == (step_mode == "eager")  # the eager layers wrote the rows themselves


def test_forward_layers_into_writes_the_same_values_into_the_given_buffers():
    ecfg = tiny_engine_config("llama", 1)
    model = build_stage_model(ecfg, range(ecfg.model.cfg.num_layers), embedding=True, head=True)
    H, last = ecfg.model.cfg.hidden_size, ecfg.model.cfg.num_layers - 1
    x = model.embed(torch.tensor([[3]]))
    with torch.no_grad():
        want, want_caps = model.forward_layers(x, model.new_cache(1, 8), 0, capture=frozenset({1}))
        into = {1: torch.empty(1, 1, H), last: torch.empty(1, 1, H)}
        got, caps = model.forward_layers(x, model.new_cache(1, 8), 0, capture=frozenset({1}), into=into)
    assert got is into[last] and caps[1] is into[1]
    assert torch.equal(got, want) and torch.equal(caps[1], want_caps[1])  # the same additions, elementwise


def test_header_with_reply_and_from_ints_build_the_named_tuple():
    hdr = Header(Kind.TOKEN, position=4, epoch=2, token=9, rows=1, slot=3)
    got = hdr.with_reply(17)
    assert got == hdr._replace(reply=17) and type(got) is Header and got.reply == 17
    back = Header.from_ints(list(got.to_ints()))
    assert back == got and back.kind is Kind.TOKEN and type(back) is Header
    with pytest.raises(RuntimeError, match="corrupt message header"):
        Header.from_ints([99] + [0] * (len(hdr) - 1))

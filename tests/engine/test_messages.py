"""The wire format (engine/protocol/messages.py): header round trip with every field exact, and what
follows each header on each link. Pure logic."""
from __future__ import annotations

import pytest
import torch

from spd_engine.engine.protocol.messages import (
    CONFIG_LEN,
    HEADER_FIELDS,
    HEADER_LEN,
    META_LEN,
    Header,
    Kind,
    WireFormat,
    parse_sampling_payload,
    sampling_payload,
)

pytestmark = pytest.mark.pure  # the fast tier: logic only, no process, no model file


def test_header_round_trip_keeps_large_integers_exact():
    h = Header(Kind.TOKEN, position=(1 << 40) + 3, epoch=12345, token=151935, length=7, reply=(1 << 33) + 1)
    t = h.to_tensor()
    assert t.dtype == torch.int64 and t.numel() == HEADER_LEN == len(HEADER_FIELDS)
    assert Header.from_tensor(t) == h


def test_corrupt_header_is_an_error():
    with pytest.raises(RuntimeError, match="corrupt message header"):
        Header.from_tensor(torch.tensor([99] + [0] * (HEADER_LEN - 1)))


def test_token_counts():
    assert Header(Kind.TOKEN, 5, token=9).num_tokens == 1
    assert Header(Kind.PREFILL, 0, length=17).num_tokens == 17
    assert Header(Kind.END).num_tokens == 0 and Header(Kind.STATS, length=9).num_tokens == 0


def test_spd_layout():
    wire = WireFormat(hidden=8, stage_anchors=(1, 0, 2, 1))
    assert [wire.reports_to_driver(s) for s in range(4)] == [True, False, True, True]
    tok, pre = Header(Kind.TOKEN, 3), Header(Kind.PREFILL, 0, length=5)
    assert [(p.name, p.shape) for p in wire.to_driver(0, tok)] == [("anchors", (1, 1, 8))]
    assert [(p.name, p.shape) for p in wire.to_driver(2, pre)] == [("anchors", (5, 2, 8))]
    assert [(p.name, p.shape) for p in wire.to_driver(3, pre)] == [("anchors", (5, 1, 8)), ("exit", (5, 8))]
    assert [(p.name, p.shape) for p in wire.downstream(pre)] == [("hidden", (5, 8))]
    assert wire.from_driver(tok) == () and wire.from_driver(pre)[0].shape == (5,)
    assert wire.from_driver(Header(Kind.CONFIG))[0].shape == (CONFIG_LEN,)
    assert wire.downstream(Header(Kind.END)) == ()
    assert wire.to_driver(1, Header(Kind.STATS, length=6))[0].shape == (6,)


def test_a_verifying_last_stage_replies_in_the_batch_table():
    """A verifying last stage's argmaxes travel in the BATCH table's reply column: its report is the
    table, the anchors and the exit rows, as a plain last stage's."""
    batch = Header(Kind.BATCH, rows=4)
    verifying = WireFormat(hidden=8, stage_anchors=(1, 1), verify_on_last=True)
    plain = WireFormat(hidden=8, stage_anchors=(1, 1))
    for wire in (verifying, plain):
        assert [(p.name, p.shape, p.kind) for p in wire.to_driver(1, batch)] == [
            ("meta", (4, META_LEN), "int64"), ("anchors", (4, 1, 8), "act"), ("exit", (4, 8), "act")]
    assert [p.name for p in verifying.to_driver(0, batch)] == ["meta", "anchors"]


def test_pipeline_layout_head_stage_replies_a_token_only():
    wire = WireFormat(hidden=8, stage_anchors=(0, 0, 0), head_on_last=True)
    assert [wire.reports_to_driver(s) for s in range(3)] == [False, False, True]
    assert wire.to_driver(2, Header(Kind.TOKEN, 4, reply=77)) == ()


def test_sampling_payload_is_exact():
    t = sampling_payload(0.7, 40, 0.95, (1 << 62) + 5)
    assert t.numel() == CONFIG_LEN and parse_sampling_payload(t) == (0.7, 40, 0.95, (1 << 62) + 5)

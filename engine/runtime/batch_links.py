"""The driver's end of the links from the stages in a run of several requests (docs/design.md
3.12), as engine/runtime/stage_links.py is one request's.

Every reporting stage answers each message with one report, in the order the driver sent them,
so its reports are read in order and each row is handed to the request in its slot: a BATCH
report's rows (its table names each row's slot) go to their requests' anchor rings and exit
rows, a PREFILL report's chunk to its request's chunk anchors. A row whose request was flushed
or has finished is stale: its (serial, epoch) no longer match, and it is dropped. At the run's
end the reports still on their way are drained.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from spd_engine.engine.comm.transport import Transport
from spd_engine.engine.protocol.messages import META_FIELDS, Kind, Payload, WireFormat

_SLOT, _SERIAL, _EPOCH = (META_FIELDS.index(f) for f in ("slot", "serial", "epoch"))
Payloads = dict[str, torch.Tensor]  # a report's tensors by name (WireFormat.to_driver)


class SlotRequest(Protocol):
    """What the links need of a request in its slot (engine/runtime/batch_driver.py)."""

    def current(self, serial: int, epoch: int | None = None) -> bool:
        """Whether a row of (serial, epoch) is this request's live one (epoch None: any of its epochs)."""

    def take_row(self, s: int, row: list[int], r: int, payloads: Payloads, anchors: slice | None) -> None:
        """Row r of stage s's BATCH report (its table row `row`); `anchors`: the stage's anchor types."""

    def take_chunk(self, s: int, start: int, payloads: Payloads, anchors: slice | None) -> None:
        """Stage s's report of its prompt chunk at `start`."""


class BatchLinks:
    """Reads the stages' reports to the driver over a run's request slots; counts what was read."""

    def __init__(self, transport: Transport, ranks: Sequence[int], wire: WireFormat,
                 stage_anchors: Sequence[Sequence[int]], timeout: float, device: torch.device,
                 dtype: torch.dtype) -> None:
        """ranks: each stage's reporting rank; stage_anchors: each stage's anchor types (ascending)."""
        self.t, self.ranks, self.wire, self.timeout = transport, list(ranks), wire, timeout
        self.device, self.dtype = device, dtype
        self.reporting = [s for s in range(len(self.ranks)) if wire.reports_to_driver(s)]
        self.anchors = [slice(a[0], a[-1] + 1) if a else None for a in stage_anchors]
        self.slots: Sequence[SlotRequest | None] = []
        self.consumed = [0] * len(self.ranks)  # reports read from each stage this run
        # a BATCH report's receive buffers by (stage, payload, shape), made once and pinned with the
        # transport (its fast path for a tick's message); a report's rows are copied out (take_row)
        # or turned into ints before the next report lands in them
        self._rows: dict[tuple[int, str, tuple[int, ...]], torch.Tensor] = {}

    def begin(self, slots: Sequence[SlotRequest | None]) -> None:
        """A new run over `slots` (the run's list: request slot -> its request, or None)."""
        self.slots = slots
        self.consumed = [0] * len(self.ranks)

    def ready(self, s: int) -> bool:
        return self.t.ready(self.ranks[s])

    def pump(self, s: int, tick: int) -> None:
        """Read stage s's next report and hand each of its rows to its request."""
        rank = self.ranks[s]
        hdr = self.t.recv_header(rank, self.timeout, tick)
        self.consumed[s] += 1
        payloads = {p.name: self.t.recv_into(rank, self._buffer(s, p, hdr.kind == Kind.BATCH), self.timeout, tick)
                    for p in self.wire.to_driver(s, hdr)}
        if hdr.kind == Kind.PREFILL:  # its epoch field carries the request's serial
            live = self.slots[hdr.slot]
            if live is not None and live.current(hdr.epoch):
                live.take_chunk(s, hdr.position, payloads, self.anchors[s])
            return
        assert hdr.kind == Kind.BATCH, f"stage {s} sent {hdr} in a run of several requests"
        for r, row in enumerate(payloads["meta"].tolist()):  # [R, META_LEN]
            live = self.slots[row[_SLOT]]
            if live is not None and live.current(row[_SERIAL], row[_EPOCH]):
                live.take_row(s, row, r, payloads, self.anchors[s])

    def _buffer(self, s: int, p: Payload, keep: bool) -> torch.Tensor:
        """A receive buffer for payload p of stage s's report (keep: a BATCH report's, reused)."""
        if keep:
            key = (s, p.name, p.shape)
            buf = self._rows.get(key)
            if buf is None:
                buf = self._rows[key] = self._buffer(s, p, False)
                self.t.pin(buf)
            return buf
        if p.kind == "act":
            return torch.empty(p.shape, device=self.device, dtype=self.dtype)
        return torch.empty(p.shape, dtype=torch.int64 if p.kind == "int64" else torch.float64)

    def drain(self, sent: int, tick: int) -> None:
        """The reports still on their way: one per message sent this run, from every reporting stage."""
        for s in self.reporting:
            while self.consumed[s] < sent:
                self.pump(s, tick)

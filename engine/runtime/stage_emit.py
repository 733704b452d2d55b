"""A stage step's last part: its output rows downstream to the next stage, and its report to the
driver (the anchors and, from the last stage, the exit rows and the head's token or argmaxes), as
engine/protocol/messages.py's WireFormat orders them. Every TOKEN or PREFILL message a reporting
stage computes produces exactly one report: the driver counts on that to drain its links at the
end of a request.
"""
from __future__ import annotations

import torch

from spd_engine.engine.comm.transport import Transport
from spd_engine.engine.protocol.messages import Header, WireFormat
from spd_engine.engine.runtime.stage_buffers import StageBuffers
from spd_engine.engine.runtime.stage_compute import StepOut


class StageEmit:
    """Sends a step's output to rank `next` (None: the last stage) and its report to `driver`."""

    def __init__(self, stage: int, transport: Transport, next_rank: int | None, driver: int, wire: WireFormat,
                 buffers: StageBuffers, reports: bool, has_head: bool) -> None:
        """reports: this rank reports by message (TP rank 0 of a reporting stage); has_head: the
        report's header carries the head's token."""
        self.stage, self.t, self.next, self.driver, self.wire = stage, transport, next_rank, driver, wire
        self.buf, self.reports, self.has_head = buffers, reports, has_head

    def token(self, hdr: Header, step: StepOut, token: int) -> None:
        """A TOKEN or PREFILL step's output and report. token: the head's (a head stage)."""
        row = self.buf.rows_out(step.out, step.caps, hdr.num_tokens, self.reports, step.written)  # [T, H]
        if self.next is not None:
            self.t.send(self.next, hdr, [row])
        if self.reports:
            self._report(hdr.with_reply(token) if self.has_head else hdr, row, step.caps)

    def batch(self, hdr: Header, meta: torch.Tensor, out: torch.Tensor, caps: dict[int, torch.Tensor]) -> None:
        """A BATCH step's table meta [R, META_LEN] and rows out [1, R, H] downstream; the report."""
        if self.next is not None:
            self.t.send(self.next, hdr, [meta, out[0]])
        if self.reports:
            tensors = {"meta": lambda: meta, "exit": lambda: out[0], "anchors": lambda: self._anchors(caps)}
            self.t.send(self.driver, hdr, [tensors[q.name]() for q in self.wire.to_driver(self.stage, hdr)])

    def _report(self, hdr: Header, row: torch.Tensor, caps: dict[int, torch.Tensor]) -> None:
        """The message to the driver: the anchors [T, k, H] (ascending) and, from the last stage, the
        exit `row` [T, H], as the wire format orders them."""
        if row is self.buf.out1:  # a one-row decode report: the payloads are the pinned rows (rows_out)
            self.t.send(self.driver, hdr, self.buf.report1)
            return
        tensors = {"exit": lambda: row}
        if self.buf.anchor_layers:
            tensors["anchors"] = lambda: self._anchors(caps)
        self.t.send(self.driver, hdr, [tensors[q.name]() for q in self.wire.to_driver(self.stage, hdr)])

    def _anchors(self, caps: dict[int, torch.Tensor]) -> torch.Tensor:
        """The captured anchor layers' outputs {layer: [1, T, H]} -> [T, k, H], ascending."""
        return torch.stack([caps[layer][0] for layer in self.buf.anchor_layers], dim=1)

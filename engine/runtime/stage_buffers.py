"""A stage's message buffers: where a message's rows are received, and the pinned rows a one-row
decode step's output and anchors leave from.

The pinned rows are registered with the transport once, so every tick's decode message leaves
from the same bytes, with no copy into a send buffer and no fresh registration. An eager step's
layers write their outputs straight into them (`into1`); a static step's outputs are copied in.
"""
from __future__ import annotations

import torch

from spd_engine.engine.comm.transport import Transport
from spd_engine.engine.model.model import StageModel
from spd_engine.engine.protocol.messages import Header, Kind, WireFormat


class StageBuffers:
    """The receive buffers of up to `rows` rows and the pinned one-row decode rows of a stage."""

    def __init__(self, model: StageModel, wire: WireFormat, stage: int, anchor_layers: list[int], reports: bool,
                 has_next: bool, transport: Transport, rows: int) -> None:
        """anchor_layers: the layers whose outputs are the stage's anchors (ascending); reports:
        this rank reports to the driver by message; has_next: a stage follows this one."""
        p = next(model.parameters())
        H = model.cfg.hidden_size
        self.device, self.dtype, self.has_next = p.device, p.dtype, has_next
        self.anchor_layers = anchor_layers
        self.h_in = torch.empty(rows, H, device=p.device, dtype=p.dtype)  # [rows, H] received hidden
        # a decode message's buffers, pinned with the transport: the hidden state in, the output row
        # out (downstream and, from the last stage, the exit), the anchors to the driver
        self.h_in1 = self.h_in[:1]  # [1, H]
        self.h_in1_3d = self.h_in1.view(1, 1, H)  # [1, 1, H]: the same bytes as the model's input
        k = len(anchor_layers)
        self.anchors1 = torch.empty(1, k, H, device=p.device, dtype=p.dtype)  # [1, k, H]
        self.anchor_rows = [self.anchors1[:, j:j + 1] for j in range(k)]  # [1, 1, H] each
        last = model.layer_range[-1] if len(model.layer_range) else None
        if k and anchor_layers[-1] == last:  # the last anchor is the stage's output: one row for both
            self.out1 = self.anchors1[0, k - 1:]  # [1, H]
        else:
            self.out1 = torch.empty(1, H, device=p.device, dtype=p.dtype)  # [1, H]
        self.out1_3d = self.out1.view(1, 1, H)  # [1, 1, H]: the same bytes, the model output's shape
        # a one-row decode report's payloads in wire order, looked up once: the pinned rows
        names = [q.name for q in wire.to_driver(stage, Header(Kind.TOKEN))]
        self.report1 = [self.anchors1 if name == "anchors" else self.out1 for name in names]
        self.pinned = transport.pins_buffers  # decode outputs land in out1 / anchors1
        # an eager one-row decode step's layers write their outputs straight into those rows
        self.into1 = {layer: row for layer, row in zip(anchor_layers, self.anchor_rows) if reports}
        if last is not None and (has_next or "exit" in names):
            self.into1[last] = self.out1_3d
        for buf in (self.h_in1, self.out1, self.anchors1):
            transport.pin(buf)
        self.ids_in = torch.empty(rows, dtype=torch.long, device=p.device)  # [rows] stage 0 prefill / chain ids
        self.tok = torch.empty(1, 1, dtype=torch.long, device=p.device)  # [1, 1] stage 0's decode token

    def rows_out(self, out: torch.Tensor, caps: dict[int, torch.Tensor], T: int, report: bool,
                 written: bool) -> torch.Tensor:
        """The output rows to send, out [1, T, H] -> [T, H]: a one-row decode output in out1 (and,
        when this stage reports by message, its anchors in their rows), the buffers pinned with
        the transport; an eager step's layers wrote them already (`written`), a static step's are
        copied from its own buffers. Else a view of out."""
        if T > 1 or not self.pinned or (not self.has_next and not report):
            return out[0]  # [T, H]
        if not written:
            self.out1_3d.copy_(out)
            if report:
                for dst, layer in zip(self.anchor_rows, self.anchor_layers):
                    dst.copy_(caps[layer])  # [1, 1, H]
        return self.out1  # [1, H]

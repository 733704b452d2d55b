"""A stage step's first part: its input rows, received from the previous rank (the driver for
stage 0) into the stage's buffers, after checking that the message fits them.

Stage 0 takes token ids (a decode token comes in the header, a BATCH message's in its table); a
later stage takes the hidden states [T, H] of the stage before.
"""
from __future__ import annotations

import torch

from spd_engine.engine.comm.transport import Transport
from spd_engine.engine.model.model import StageModel
from spd_engine.engine.protocol.messages import META_FIELDS, META_LEN, Header, Kind
from spd_engine.engine.runtime.stage_buffers import StageBuffers

_TOKEN = META_FIELDS.index("token")


class StageInput:
    """Receives a message's rows from rank `prev` into `buffers`."""

    def __init__(self, stage: int, model: StageModel, transport: Transport, prev: int, timeout: float,
                 buffers: StageBuffers, capacity: int) -> None:
        """capacity: positions a request may reach."""
        self.stage, self.model, self.t, self.prev, self.timeout = stage, model, transport, prev, timeout
        self.buf, self.capacity = buffers, capacity
        # a BATCH message's receive buffers by row count: made once, pinned with the transport (its
        # fast path for a tick's message); a step is done with them before the next message lands
        self._tables: dict[int, torch.Tensor] = {}  # R -> [R, META_LEN]
        self._rows: dict[int, torch.Tensor] = {}  # R -> [R, H]

    def check(self, hdr: Header) -> None:
        """RuntimeError if a TOKEN or PREFILL message reaches past the KV cache or the buffers."""
        T, pos = hdr.num_tokens, hdr.position
        if pos >= self.capacity or pos + T > self.capacity or T > self.buf.h_in.shape[0]:
            raise RuntimeError(f"stage {self.stage}: message {hdr} exceeds KV capacity {self.capacity} "
                               f"or prefill chunk {self.buf.h_in.shape[0]}")

    def token_rows(self, hdr: Header, tick: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """A TOKEN or PREFILL message's input: (ids [1, T] or [1, 1], None) on stage 0, else (None,
        the hidden states [1, T, H]); a one-row decode's land in the pinned h_in1."""
        T = hdr.num_tokens
        if self.stage == 0:
            if hdr.kind == Kind.TOKEN and T == 1:
                return self.buf.tok.fill_(hdr.token), None  # [1, 1]
            return self.t.recv_into(self.prev, self.buf.ids_in[:T], self.timeout, tick)[None], None  # [1, T]
        if T == 1:
            self.t.recv_into(self.prev, self.buf.h_in1, self.timeout, tick)
            return None, self.buf.h_in1_3d  # [1, 1, H]
        return None, self.t.recv_into(self.prev, self.buf.h_in[:T], self.timeout, tick)[None]  # [1, T, H]

    def batch_rows(self, hdr: Header, tick: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A BATCH message's table meta [R, META_LEN] (host int64) and its rows: stage 0's token ids
        [1, R] (the table's), a later stage's hidden states h [1, R, H]."""
        R, H = hdr.rows, self.model.cfg.hidden_size
        meta = self.t.recv_into(self.prev, self._kept(self._tables, R, META_LEN, torch.int64, torch.device("cpu")),
                                self.timeout, tick)
        if self.stage == 0:
            return meta, meta[None, :, _TOKEN].to(self.buf.device)  # [1, R]
        h = self.t.recv_into(self.prev, self._kept(self._rows, R, H, self.buf.dtype, self.buf.device), self.timeout, tick)
        return meta, h[None]  # [1, R, H]

    def _kept(self, kept: dict[int, torch.Tensor], R: int, width: int, dtype: torch.dtype, device: torch.device
              ) -> torch.Tensor:
        """The pinned [R, width] receive buffer of R rows, made on first use."""
        buf = kept.get(R)
        if buf is None:
            buf = kept[R] = torch.empty(R, width, dtype=dtype, device=device)
            self.t.pin(buf)
        return buf

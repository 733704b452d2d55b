"""How the driver hands messages to stage 0, in each of its layouts (docs/design.md 3.1, 3.3):

- a separate rank (every TP rank of stage 0 takes the token): a message;
- co-located, inline: a message over the loopback, then stage 0 steps on it here, in series;
- co-located, overlapped (n >= 2): stage 0 steps on its own thread (engine/runtime/stage0_overlap.py)
  while the driver drafts and verifies, joined at the end of the tick;
- co-located, direct (inline, W = 1, no TP): a decode token is a call, no message, and stage 0's
  anchors go straight into the driver's ring slot of the token's position.
"""
from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from spd_engine.engine.comm.transport import Transport
from spd_engine.engine.protocol.messages import Header
from spd_engine.engine.protocol.topology import Topology
from spd_engine.engine.runtime.driver_buffers import DriverBuffers
from spd_engine.engine.runtime.request_state import RequestState
from spd_engine.engine.runtime.stage0_overlap import Stage0Runner
from spd_engine.engine.runtime.stage_links import StageLinks
from spd_engine.engine.runtime.stage_worker import StageWorker


class Stage0Port:
    def __init__(self, topo: Topology, transport: Transport, links: StageLinks, buffers: DriverBuffers,
                 local: StageWorker | None, overlap: bool, width: int) -> None:
        self.topo, self.t, self.links, self.buf, self.local = topo, transport, links, buffers, local
        device = buffers.ring.device
        self.runner = Stage0Runner(local.step, device) if local is not None and overlap and topo.n >= 2 else None
        self.direct = local is not None and self.runner is None and topo.n >= 2 and topo.tp == 1 and width == 1
        if self.direct:
            local.local_reports = self._local_anchors
        # direct and eager: stage 0's embedding of the entering token is its anchor 0 (the same
        # weights), so the driver does not embed it again (a static stage 0 step keeps it inside)
        self.anchor0_from_stage0 = self.direct and local.static is None
        self._reports = int(buffers.wire.reports_to_driver(0))  # messages a stage 0 step counts as read

    def send(self, hdr: Header, payloads: Sequence[torch.Tensor] = (), overlap: bool = False,
             req: RequestState | None = None) -> None:
        """Post a message to stage 0; co-located, stage 0 steps on it now, inline, or (overlap, a
        decode tick) on its runner thread until `join` at the end of the tick."""
        t0 = time.perf_counter()
        for rank in self.topo.stage_ranks(0):  # every TP rank of stage 0 takes the token (docs/design.md 3.9)
            self.t.send(rank, hdr, payloads)
        if req is not None:
            self.links.sent += int(hdr.num_tokens > 0)
            req.account("send", t0)
        if overlap and self.runner is not None:
            self.runner.start()
        elif self.local is not None:  # co-located: stage 0 runs inline, in series with the driver
            t1 = time.perf_counter()
            self.local.step()
            if req is not None:
                req.account("stage0", t1)

    def step_direct(self, hdr: Header, req: RequestState, ids: torch.Tensor | None = None) -> None:
        """A decode token (a suffix run: its ids [T]) to the co-located stage 0, stepped inline
        without a message."""
        t0 = time.perf_counter()
        self.links.sent += 1
        self.local.step_local(hdr, ids)
        req.account("stage0", t0)

    def _local_anchors(self, hdr: Header, caps: dict[int, torch.Tensor], emb: torch.Tensor | None) -> None:
        """Stage 0's anchors of a token it stepped in-process (and its embedding [1, 1, H], anchor 0,
        unless the step was static), into the ring slot of its position: next tick's anchor read
        of that token (plan.anchor_reads) is then already done. The slot is the entering token's,
        so no live row reads it for anything else (docs/design.md 3.3)."""
        for i in range(hdr.num_tokens):  # a suffix run's positions: one ring slot each
            rows = self.buf.ring_rows[self.buf.slot(hdr.position + i)]
            if emb is not None:
                rows[0].copy_(emb[:, i:i + 1])  # [1, 1, H]
            for a, layer in zip(self.buf.stage_anchors[0], self.local.anchor_layers):
                rows[a].copy_(caps[layer][:, i:i + 1])  # [1, 1, H]
        self.links.consumed[0] += self._reports

    def join(self, req: RequestState) -> None:
        """The end of an overlapped tick: `stage0` then counts only the wait for stage 0's step."""
        if self.runner is not None:
            t0 = time.perf_counter()
            self.runner.join()
            req.account("stage0", t0)

    def close(self) -> None:
        if self.runner is not None:
            self.runner.close()

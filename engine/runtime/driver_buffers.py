"""The driver's preallocated buffers and how the stages' payloads land in them (docs/design.md 3.3).

Anchor states live in rings `[W, slots, m, H]` indexed by position (slot = pos mod (n + 2), so
every live position has its own; with suffix runs of up to `max_run` tokens, (n + 2) max_run): chain c's
anchors in rings[c], ring 0 the representative's
(the only one at W = 1). The last stage's exit hidden states land in `exit_buf` (a verifying last stage's argmaxes of a
suffix run's rows in `replies`), anchors nobody
reads (prefill chunks, stale messages) in per-stage scratch. A decode tick's destinations are
sliced once and pinned with the transport, and the index tensors of a tick's PDM rows are built
once per (first slot, row count) and (pending, fill).
"""
from __future__ import annotations

import torch

from spd_engine.engine.comm.transport import Transport
from spd_engine.engine.protocol.anchors import AnchorPlan
from spd_engine.engine.protocol.messages import Header, Kind, WireFormat
from spd_engine.engine.protocol.tick import TickPlan


class DriverBuffers:
    def __init__(self, n: int, plan: AnchorPlan, wire: WireFormat, hidden: int, rows: int, width: int,
                 transport: Transport, device: torch.device, dtype: torch.dtype, max_run: int = 1) -> None:
        H, m = hidden, plan.num_types
        self.n, self.wire, self.t = n, wire, transport
        # the pending rows and n live entries, each up to max_run positions, and one entry's headroom
        self.num_slots = (n + 2) * max_run
        self.rings = torch.zeros(width, self.num_slots, m, H, device=device, dtype=dtype)  # [W, slots, m, H]
        self.ring = self.rings[0]  # [slots, m, H]
        self.exit_buf = torch.empty(rows, H, device=device, dtype=dtype)  # [chunk, H]
        self.exit_row = self.exit_buf[:1]  # [1, H]
        self.replies = torch.full((rows,), -1, dtype=torch.int64)  # [chunk]: a verifying last stage's run argmaxes
        self.stage_anchors = [plan.anchors_of_stage(s) for s in range(n)]
        for ids in self.stage_anchors:
            assert list(ids) == list(range(ids[0], ids[0] + len(ids))) if ids else True
        self.scratch = [torch.empty(rows, len(ids), H, device=device, dtype=dtype)
                        for ids in self.stage_anchors]  # [chunk, k, H]: anchors nobody reads into the ring
        # a decode tick's receive destinations: stage s's anchors of ring slot i [1, k, H], one exit row
        self.anchor_dest = [[self.ring[i:i + 1, ids[0]:ids[-1] + 1] if ids else None
                             for i in range(self.num_slots)] for ids in self.stage_anchors]
        # what a decode tick's report from stage s carries, in order ("anchors", "exit")
        self.decode_report = [tuple(p.name for p in wire.to_driver(s, Header(Kind.TOKEN))) for s in range(n)]
        for dest in [self.exit_row] + [d for per_stage in self.anchor_dest for d in per_stage if d is not None]:
            transport.pin(dest)
        # ring[slot, a] as [1, 1, H], the shape of a co-located stage 0's embedding and captured anchors
        self.ring_rows = [[self.ring[i, a].view(1, 1, H) for a in range(m)] for i in range(self.num_slots)]
        self.full_type = plan.type_at_depth(n)
        self.depth_types = depth_types = [plan.type_at_depth(d) for d in range(n + 1)]
        self._run_types: dict[tuple[int, ...], torch.Tensor] = {}  # depths of a tick with a suffix run -> types
        # a tick's rows are consecutive positions from the PDM cache end (the pending row, then the
        # staircase oldest -> newest): their slots depend on (first slot, count), their types on (pending, fill)
        self.row_slots = {(a, R): torch.tensor([(a + i) % self.num_slots for i in range(R)], device=device)
                          for a in range(self.num_slots) for R in range(1, self.num_slots)}
        self.row_types = {(pending, L): torch.tensor([self.full_type] * pending +
                                                     [depth_types[j] for j in range(L - 1, -1, -1)], device=device)
                          for pending in (0, 1) for L in range(1, n + 1)}

    def slot(self, pos: int) -> int:
        return pos % self.num_slots

    def types_of(self, plan: TickPlan) -> torch.Tensor:
        """[R] the anchor types of the tick's rows."""
        pending = int(plan.rows[0].pending)
        if len(plan.rows) == pending + plan.fill:  # one row per live token, at most one pending row
            return self.row_types[(pending, plan.fill)]
        depths = tuple(r.depth for r in plan.rows)  # a suffix run in flight or among the pending rows
        types = self._run_types.get(depths)
        if types is None:
            types = self._run_types[depths] = torch.tensor([self.depth_types[d] for d in depths],
                                                           device=self.ring.device)
        return types

    def slots_of(self, plan: TickPlan) -> torch.Tensor:
        """[R] the ring slots of the tick's rows."""
        return self.row_slots[(self.slot(plan.pdm_pos), len(plan.rows))]

    def read_payloads(self, rank: int, s: int, hdr: Header, where: tuple[int, int] | None, timeout: float,
                      tick: int) -> None:
        """The payloads behind stage s's header: anchors to ring slot `where[0]` (None: scratch), the
        last stage's exit hidden states to exit_buf. A chains message (hdr.rows = W): chain c's
        anchors to rings[c], the representative's (row `where[1]`) to ring 0."""
        if where is not None and hdr.kind == Kind.TOKEN and hdr.num_tokens == 1:  # a decode tick's: pinned rows
            for name in self.decode_report[s]:
                dest = self.exit_row if name == "exit" else self.anchor_dest[s][where[0]]
                self.t.recv_into(rank, dest, timeout, tick)
            return
        ids = self.stage_anchors[s]
        chains = hdr.kind == Kind.TOKEN and hdr.rows > 1
        run = hdr.kind == Kind.TOKEN and hdr.length > 1  # a suffix run: one ring slot per position
        for payload in self.wire.to_driver(s, hdr):
            if payload.name == "anchors":
                dest = self.scratch[s][:hdr.num_tokens] if where is None or chains or run else \
                    self.anchor_dest[s][where[0]]  # [1, k, H], contiguous
            elif payload.name == "replies":
                dest = self.replies[:hdr.num_tokens]
            else:
                assert payload.name == "exit", payload
                dest = self.exit_row if hdr.num_tokens == 1 else self.exit_buf[:hdr.num_tokens]
            self.t.recv_into(rank, dest, timeout, tick)
            if payload.name == "anchors" and run and where is not None:
                for i in range(hdr.num_tokens):
                    self.ring[self.slot(hdr.position + i), ids[0]:ids[-1] + 1] = dest[i]  # [k, H]
            if payload.name == "anchors" and chains and where is not None:
                a = slice(ids[0], ids[-1] + 1)
                self.rings[:hdr.rows, where[0], a] = dest  # [W, k, H]
                self.ring[where[0], a] = dest[where[1]]

"""A request slot's driver-side buffers (docs/design.md 3.3, 3.12).

Anchor states live in rings `[W, slots, m, H]` indexed by position (slot = pos mod (n + 2), so
every live position has its own; with suffix runs of up to `max_run` tokens, (n + 2) max_run): chain c's
anchors in rings[c], ring 0 the representative's (the only one at W = 1). The index tensors of a
tick's PDM rows are built once per (first slot, row count) and (pending, fill).
"""
from __future__ import annotations

import torch

from spd_engine.engine.protocol.anchors import AnchorPlan
from spd_engine.engine.protocol.tick import TickPlan


class DriverBuffers:
    def __init__(self, n: int, plan: AnchorPlan, hidden: int, width: int, device: torch.device, dtype: torch.dtype,
                 max_run: int = 1) -> None:
        H, m = hidden, plan.num_types
        self.n = n
        # the pending rows and n live entries, each up to max_run positions, and one entry's headroom
        self.num_slots = (n + 2) * max_run
        self.rings = torch.zeros(width, self.num_slots, m, H, device=device, dtype=dtype)  # [W, slots, m, H]
        self.ring = self.rings[0]  # [slots, m, H]
        self.stage_anchors = [plan.anchors_of_stage(s) for s in range(n)]
        for ids in self.stage_anchors:
            assert list(ids) == list(range(ids[0], ids[0] + len(ids))) if ids else True
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

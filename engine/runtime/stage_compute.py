"""A stage step's middle part: its rows through the stage's layers.

A one-token decode step (a TOKEN message, or a BATCH message of one plain token of slot 0: a
request alone) runs on the static (CUDA-graph) step when the run has one; prefill chunks, suffix
runs (docs/design.md 3.13), the W chains of a branch point (3.11) and BATCH steps over several
requests (3.12) run eagerly. Rollback is lazy (3.4): a row at position `q` writes
its K/V at slot `q`, over whatever a stale token left there.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from spd_engine.engine.model.graphs import StageStep
from spd_engine.engine.model.model import StageModel
from spd_engine.engine.protocol.messages import META_FIELDS, Header, Kind
from spd_engine.engine.runtime.run_config import StepMode
from spd_engine.engine.runtime.slot_caches import SlotCaches
from spd_engine.engine.runtime.stage_buffers import StageBuffers

_SLOT, _POSITION, _BRANCH = (META_FIELDS.index(f) for f in ("slot", "position", "branch"))


class StepOut(NamedTuple):
    """What a TOKEN or PREFILL step computed."""

    out: torch.Tensor  # [1, T, H] the stage's output
    caps: dict[int, torch.Tensor]  # captured layer -> its output [1, T, H] (the anchors)
    greedy: torch.Tensor | None  # a static step's head argmax [1] (device), else None
    written: bool  # the eager layers wrote out and the anchors into the pinned rows already


class StageCompute:
    """Runs a message's rows through the stage's layers on the request slots' caches."""

    def __init__(self, stage: int, model: StageModel, caches: SlotCaches, capture: frozenset[int],
                 buffers: StageBuffers, step_mode: StepMode, head: bool) -> None:
        """step_mode: how one-token steps run; head: a static step runs the head's argmax too."""
        self.stage, self.model, self.caches, self.capture, self.buf = stage, model, caches, capture, buffers
        self.static = None if step_mode == StepMode.EAGER else \
            StageStep(model, caches.first, graphs=step_mode == StepMode.GRAPH, capture=capture, head=head)

    def prepare(self) -> None:
        """Every length bucket of the static step now, not inside a timed request."""
        if self.static is not None:
            self.static.prepare()

    def token(self, hdr: Header, ids: torch.Tensor | None, h: torch.Tensor | None) -> StepOut:
        """A TOKEN or PREFILL message's step on ids [1, T] (stage 0) or h [1, T, H]."""
        one = hdr.kind == Kind.TOKEN  # pp / ar decode: one token
        if self.static is not None and one:
            # static buffers that the next step rewrites: everything that leaves this step is copied
            # out by this message's emit step (out1 and anchors1 into the transport, anchors into
            # the co-located driver's ring), so no clone is needed
            out, caps, greedy = self.static.run(hdr.position, h=None if self.stage == 0 else h, token=ids)
            return StepOut(out, caps, greedy, False)
        h = self.model.embed(ids) if self.stage == 0 else h  # [1, T, H]
        into = self.buf.into1 if one and self.buf.pinned else None
        cache = self.caches.first if hdr.slot == 0 else self.caches.of(hdr.slot)
        out, caps = self.model.forward_layers(h, cache, hdr.position, capture=self.capture, into=into)
        return StepOut(out, caps, None, into is not None)

    def batch(self, meta: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """A BATCH step: the rows of table meta [R, META_LEN] (stage 0's ids [1, R], a later stage's
        h [1, R, H]), each on its request slot's cache -> (out [1, R, H], anchors {layer: [1, R, H]}).
        One plain token of slot 0 (a request alone) runs on the static step when the run has one;
        every other step runs eagerly."""
        if self.static is not None and len(meta) == 1 and meta[0, _SLOT] == 0 and meta[0, _BRANCH] < 0:
            # static buffers that the next step rewrites: the emit step copies out what leaves it
            out, caps, _ = self.static.run(int(meta[0, _POSITION]), h=None if self.stage == 0 else rows,
                                           token=rows if self.stage == 0 else None)
            return out, caps
        h = self.model.embed(rows) if self.stage == 0 else rows  # [1, R, H]
        caches = self.caches.batch_rows(meta, self.buf.device)
        return self.model.forward_layers(h, caches, 0, positions=meta[None, :, _POSITION].to(self.buf.device),
                                         capture=self.capture)

"""What the driver keeps of each draft until it is verified: the source that made it and, at T > 0,
the exact q it was drawn from (docs/design.md 3.6), per chain (docs/design.md 3.11).

A position drafted while no branch point is in flight has one chain; a position drafted by the W
chains of a branch point in flight, or a branch point's own W candidates, has W. When a branch
point resolves, the survivor's chain is kept (`adopt`). A re-draft after a flush replaces the
record; verification takes the record of its position and drops the older ones.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from spd_engine.engine.protocol.verify_multi import Candidate


@dataclass
class DraftRecord:
    sources: list[str | None]  # per chain: the draft source (engine/protocol/drafting.py)
    qs: list[torch.Tensor | None]  # per chain, T > 0: q [V] the draft was drawn from
    cands: list[Candidate] | None = None  # a branch point's candidates at T > 0

    @property
    def width(self) -> int:
        return len(self.sources)


class DraftRecords:
    def __init__(self) -> None:
        self.at: dict[int, DraftRecord] = {}

    def keep(self, pos: int, source: str, q: torch.Tensor | None = None, chain: int = 0, width: int = 1) -> None:
        """Chain `chain` of `width` drafted `pos` from `source` (and q); chain 0 starts the record."""
        if chain == 0:
            self.at[pos] = DraftRecord([None] * width, [None] * width)
        rec = self.at[pos]
        assert rec.width == width, (pos, rec.width, width)
        rec.sources[chain], rec.qs[chain] = source, q

    def keep_candidates(self, pos: int, sources: list[str], cands: list[Candidate] | None) -> None:
        """A branch point's candidates: their sources, and at T > 0 the candidates with their q."""
        self.at[pos] = DraftRecord(list(sources), [None] * len(sources), cands)

    def adopt(self, k: int) -> None:
        """A branch point resolved with chain k surviving: every per-chain record keeps chain k's."""
        for pos, rec in self.at.items():
            if rec.width > 1:
                self.at[pos] = DraftRecord([rec.sources[k]], [rec.qs[k]])

    def take(self, pos: int) -> DraftRecord:
        """The record of the draft verified at `pos`; older ones (never verified: flushed) go too."""
        rec = self.at.pop(pos)
        for stale in [p for p in self.at if p < pos]:
            del self.at[stale]
        return rec

"""The records of the exact T=0 replays (train/fast_eval.py, train/run_replay.py): a request's
counters and the teacher-forced draft table they are replayed from."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from spd_engine.engine.protocol.metrics import Counters


@dataclass(kw_only=True)
class Acceptance(Counters):
    """One request's counters (engine/protocol/metrics.py), with its token count N (the first token
    and a final EOS included) and the drafts by source."""

    n: int
    tokens: int
    # draft source (engine/protocol/drafting.py) -> [verified, accepted]; empty when not recorded
    by_source: dict[str, list[int]] = field(default_factory=dict, compare=False)  # checked on its own


@dataclass
class DraftTable:
    """Teacher-forced drafts: row f - 1, column t = the draft (target id) for index t + 1 made at a
    tick whose newest token is y[t] with fill f; margin = top-1 minus top-2 draft logit."""

    drafts: torch.Tensor  # [n, N-1] int64
    margins: torch.Tensor  # [n, N-1] fp32
    top: torch.Tensor  # [n, N-1, k <= 4] int64: the k best draft ids, best first (recall of top-k)

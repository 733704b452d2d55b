"""Offline scoring of drafting policies with the exact T=0 replay (train/fast_eval.py).

Per prompt, one greedy reference and one draft table (the PDM's top-4 at every fill) serve every
policy: `score_prompt` replays the request under each DraftChooser and measures, over the draft
states the pdm-only driver visits, the PDM's top-1/2/4 recall of the target's token and, for the
suffix draft, its coverage (how often it proposes) and precision (how often that proposal is the
target's token). Per fill, because most drafts are made while the pipeline refills.

A prompt "loops" when a quarter or more of its generated positions end a 16-token span that
already occurred in prompt + output (`repeated_fraction`): small greedy models repeat
themselves, and suffix drafts profit most from that, so results are also reported without them.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from spd_engine.engine.protocol.drafting import DraftChooser
from spd_engine.train.fast_eval import Acceptance, DraftTable, replay_table, suffix_table

LOOP_SPAN = 16
LOOP_FRACTION = 0.25


def repeated_fraction(prompt: Sequence[int], y: Sequence[int], span: int = LOOP_SPAN) -> float:
    """Fraction of the generated positions that end a `span`-token window seen earlier in prompt + y."""
    seq = [*prompt, *y]
    P, seen, hits = len(prompt), set(), 0
    for end in range(span - 1, len(seq)):
        key = tuple(seq[end - span + 1:end + 1])
        if end >= P and key in seen:
            hits += 1
        seen.add(key)
    return hits / len(y) if y else 0.0


def loops(prompt: Sequence[int], y: Sequence[int]) -> bool:
    return repeated_fraction(prompt, y) >= LOOP_FRACTION


@dataclass
class StateStats:
    """Over the draft states (fill f, newest index t) a pdm-only driver consults, per fill:
    [count, PDM top-1 hits, top-2 hits, top-4 hits, suffix proposals, suffix hits]."""

    by_fill: dict[int, list[int]] = field(default_factory=dict)

    def add(self, fill: int, row: list[int]) -> None:
        cell = self.by_fill.setdefault(fill, [0] * 6)
        for i, v in enumerate(row):
            cell[i] += v

    def merge(self, other: "StateStats") -> None:
        for f, row in other.by_fill.items():
            self.add(f, row)

    def total(self) -> list[int]:
        out = [0] * 6
        for row in self.by_fill.values():
            out = [a + b for a, b in zip(out, row)]
        return out


def state_stats(table: DraftTable, y: Sequence[int], prompt: Sequence[int], n: int, consulted,
                chooser: DraftChooser) -> StateStats:
    """Recall and suffix coverage / precision over the consulted draft states."""
    proposals = suffix_table(chooser, prompt, y, n) if chooser.uses_suffix else None
    top = table.top.tolist()
    stats = StateStats()
    for f, t in sorted(consulted):
        want = y[t + 1]
        ranked = top[f - 1][t]
        prop = proposals[f - 1][t] if proposals is not None else None
        proposes = prop is not None and prop.length >= chooser.suffix.min_match
        stats.add(f, [1, int(want in ranked[:1]), int(want in ranked[:2]), int(want in ranked[:4]),
                      int(proposes), int(proposes and prop.token == want)])
    return stats


def score_prompt(table: DraftTable, y: Sequence[int], prompt: Sequence[int], n: int,
                 policies: dict[str, DraftChooser], probe: DraftChooser) -> tuple[dict[str, Acceptance], StateStats]:
    """(Acceptance per policy, recall / suffix statistics over the pdm-only driver's states)."""
    P = len(prompt)
    out = {name: replay_table(table, y, P, n, chooser, prompt=prompt).acceptance for name, chooser in policies.items()}
    base = replay_table(table, y, P, n, DraftChooser(), prompt=prompt)
    return out, state_stats(table, y, prompt, n, base.consulted, probe)

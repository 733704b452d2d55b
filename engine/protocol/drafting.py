"""Draft sources and the chooser: per tick, the PDM's draft or the suffix draft (engine/protocol/suffix.py).
Pure logic, no torch.

The rule is measured, not guessed (docs/eval.md, "Draft sources"): a suffix proposal wins when
its match is at least `min_match` tokens long and the PDM's top-1 margin (top-1 minus top-2
draft logit) is below `pdm_margin`; otherwise the PDM drafts. Both the exact T=0 replay
(train/fast_eval.py) and the driver call `choose`, so they make the same choice.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from spd_engine.engine.protocol.suffix import CrossRequestHistory, SuffixIndex, SuffixProposal, SuffixSettings

PDM, SUFFIX = "pdm", "suffix"
SUFFIX_RUN = "suffix-run"  # the tokens a suffix draft carries after it (its run, docs/design.md 3.13)
SOURCES = (PDM, SUFFIX, SUFFIX_RUN)


@dataclass(frozen=True)
class DraftChooser:
    suffix: SuffixSettings | None = None  # None: the PDM drafts every token
    pdm_margin: float = math.inf  # the suffix draft wins only below this PDM margin
    cross_request: bool = False  # also look up earlier requests of the process (CrossRequestHistory)

    @property
    def uses_suffix(self) -> bool:
        return self.suffix is not None

    def choose(self, pdm_token: int, pdm_margin: float, proposal: SuffixProposal | None) -> tuple[int, str]:
        """(token, source) for one draft."""
        if proposal is not None and proposal.length >= self.suffix.min_match and pdm_margin < self.pdm_margin:
            return proposal.token, SUFFIX
        return pdm_token, PDM

    def new_history(self) -> CrossRequestHistory | None:
        """The process's cross-request history (None unless cross_request)."""
        return CrossRequestHistory(self.suffix) if self.suffix is not None and self.cross_request else None

    def new_index(self, prompt: Sequence[int]) -> SuffixIndex | None:
        """A request's suffix index over its prompt (None without suffix drafts)."""
        if self.suffix is None:
            return None
        index = SuffixIndex(self.suffix)
        index.extend(prompt)
        return index


def parse_suffix_drafts(value: str) -> bool:
    """--suffix-drafts on|off."""
    if value not in ("on", "off"):
        raise ValueError(f"--suffix-drafts takes on or off, got {value!r}")
    return value == "on"

"""Branch width W: which candidates a draft position gets when several chains may travel the
pipeline at once (docs/design.md 3.11). Pure logic, no torch.

A branch point is a draft position that gets up to W candidate tokens instead of one; each
candidate starts a chain, every chain drafts its own next tokens (one per tick), and when the
branch point is verified the chain whose token is the target's survives (none: a rejection, the
flush of today). At most one branch point is in flight at a time, so a stage step carries at
most W tokens (the budget). `when` says where a branch may start:
- "refill": only at the first draft after a rejection or the prefill (fill 1), where most drafts
  are made and the PDM is least sure;
- "always": at any draft while no branch point is in flight.
At W = 1 nothing branches: exactly today's SPD.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

WHEN = ("refill", "always")


@dataclass(frozen=True)
class BranchPolicy:
    width: int = 1  # W
    when: str = "refill"

    def __post_init__(self) -> None:
        if self.width < 1:
            raise ValueError(f"--branches must be >= 1, got {self.width}")
        if self.when not in WHEN:
            raise ValueError(f"branch policy must be one of {WHEN}, got {self.when!r}")

    def branches(self, fill: int, in_flight: bool) -> bool:
        """Whether the draft made now (at this fill; a branch point already in flight or not) branches."""
        return self.width > 1 and not in_flight and (self.when == "always" or fill == 1)

    def candidates(self, chosen: tuple[int, str], ranked: Sequence[int], suffix: int | None
                   ) -> list[tuple[int, str]]:
        """Up to W distinct (token, source): the chooser's draft first, then the suffix proposal,
        then the PDM's ranked drafts (best first)."""
        out = [chosen]
        pool = ([(suffix, "suffix")] if suffix is not None else []) + [(t, "pdm") for t in ranked]
        for tok, src in pool:
            if len(out) == self.width:
                break
            if all(tok != t for t, _ in out):
                out.append((tok, src))
        return out

"""What a PDM training step draws and how fast it learns: the fill of the simulated tick and the
learning rate. Pure logic, no torch.

Fills: by default half the batches are at the full pipeline (f = n) and the rest uniform over
1..n-1. `fill_weights` replaces that with one weight per fill 1..n, e.g. how often the driver
really drafts at each fill (`spd eval --json`: `verified_by_fill`; at the shipped head's
acceptance most drafts are made at fill 1, right after a rejection).

Learning rate, after a linear warmup:
- `cosine`: cosine decay to 10% over the whole run. Its shape depends on the total step count,
  so a finished run cannot be extended: resuming with another --steps is refused.
- `wsd` (warmup-stable-decay): constant until the last `decay_frac` of the steps, then a linear
  decay to 10%. The trainer keeps the state at the step where the decay starts (`stable.pt`),
  so a longer run resumes from there and decays once, at its own end.
"""
from __future__ import annotations

import math
import random
from collections.abc import Sequence

SCHEDULES = ("cosine", "wsd")
FLOOR = 0.1  # both schedules end at 10% of the peak


def check_fill_weights(weights: Sequence[float] | None, n: int) -> None:
    if weights is None:
        return
    if len(weights) != n or min(weights) < 0 or not sum(weights) > 0:
        raise ValueError(f"fill weights need {n} non-negative values (fills 1..{n}) with a positive sum, "
                         f"got {list(weights)}")


def draw_fill(n: int, full_frac: float, rng: random.Random, weights: Sequence[float] | None = None) -> int:
    """The fill of one training batch."""
    if weights is not None:
        return rng.choices(range(1, n + 1), weights=weights)[0]
    if n == 1 or rng.random() < full_frac:
        return n
    return rng.randint(1, n - 1)


def decay_start(steps: int, warmup: int, decay_frac: float) -> int:
    """The first step of the wsd decay (never inside the warmup)."""
    return max(warmup, steps - round(decay_frac * steps))


def schedule_lr(step: int, peak: float, steps: int, warmup: int, schedule: str = "cosine",
                decay_frac: float = 0.2) -> float:
    """The learning rate of optimizer step `step` (0-based)."""
    if step < warmup:
        return peak * (step + 1) / warmup
    if schedule == "cosine":
        t = (step - warmup) / max(1, steps - warmup)
        return peak * (FLOOR + (1 - FLOOR) * 0.5 * (1 + math.cos(math.pi * min(1.0, t))))
    assert schedule == "wsd", schedule
    start = decay_start(steps, warmup, decay_frac)
    if step < start:
        return peak
    t = (step - start) / max(1, steps - start)
    return peak * (1 - (1 - FLOOR) * min(1.0, t))

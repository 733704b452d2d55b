"""Anchor plan: which hidden states the PDM reads, and which aggregation type each depth uses.

Anchors `b_0 = 0 < b_1 < ... < b_{m-1} <= L-1` are layer indices: anchor 0 is the embedding
output, anchor `k > 0` the raw (pre-final-norm) output of layer `k-1`. Aggregation type `a`
is the anchor set `{b_0..b_a}`; a token at depth `d` (stages `0..d-1` done, layers below
`B_d` computed) uses type `A(d) = max{a : b_a <= B_d}`. Pure logic, no torch.distributed.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass

# Stage boundaries B_k whose index k picks the default anchors (those with k < n).
DEFAULT_BOUNDARY_INDICES = (1, 3, 6)


def _as_ints(what: str, values) -> tuple[int, ...]:
    values = tuple(values)
    if any(isinstance(v, bool) or not isinstance(v, int) for v in values):
        raise ValueError(f"{what} must be integers, got {list(values)}")
    return values


def _check_bounds(bounds: tuple[int, ...]) -> None:
    if len(bounds) < 2 or bounds[0] != 0:
        raise ValueError(f"stage bounds must start at 0 and hold at least one stage, got {list(bounds)}")
    if any(b <= a for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"stage bounds must be strictly increasing, got {list(bounds)}")


def _check_anchors(anchors: tuple[int, ...], num_layers: int) -> None:
    if not anchors or anchors[0] != 0:
        raise ValueError(f"anchors must start with 0 (the embedding output), got {list(anchors)}")
    if any(b <= a for a, b in zip(anchors, anchors[1:])):
        raise ValueError(f"anchors must be sorted and unique, got {list(anchors)}")
    if anchors[-1] > num_layers - 1:
        raise ValueError(f"anchor {anchors[-1]} is out of range: anchors must be <= L-1 = {num_layers - 1}")


def _depth_types(bounds: tuple[int, ...], anchors: tuple[int, ...]) -> tuple[int, ...]:
    """A(d) for d = 0..n: the index of the deepest anchor computed at depth d."""
    return tuple(bisect.bisect_right(anchors, b) - 1 for b in bounds)


def default_anchors(bounds: list[int] | tuple[int, ...]) -> tuple[int, ...]:
    """{0, B_1, B_3, B_6 (those with index < n), L-1}, sorted and deduplicated (before pruning)."""
    bounds = _as_ints("stage bounds", bounds)
    _check_bounds(bounds)
    n, num_layers = len(bounds) - 1, bounds[-1]
    picked = {0, num_layers - 1} | {bounds[k] for k in DEFAULT_BOUNDARY_INDICES if k < n}
    return tuple(sorted(picked))


def prune_anchors(bounds: list[int] | tuple[int, ...],
                  anchors: list[int] | tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(kept, dropped): drop every anchor whose type no depth selects, until none is dropped.

    Such an anchor would only ever be read together with a deeper one, so its projection
    W_a would never be used.
    """
    bounds, kept = _as_ints("stage bounds", bounds), _as_ints("anchors", anchors)
    _check_bounds(bounds)
    _check_anchors(kept, bounds[-1])
    dropped: list[int] = []
    while True:
        selected = set(_depth_types(bounds, kept))
        unused = [b for a, b in enumerate(kept) if a not in selected]
        if not unused:
            return kept, tuple(sorted(dropped))
        dropped += unused
        kept = tuple(b for a, b in enumerate(kept) if a in selected)


@dataclass(frozen=True)
class AnchorPlan:
    """Stage bounds B_0..B_n plus the anchors; every aggregation type is selected by some depth."""

    bounds: tuple[int, ...]
    anchors: tuple[int, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "bounds", _as_ints("stage bounds", self.bounds))
        object.__setattr__(self, "anchors", _as_ints("anchors", self.anchors))
        _check_bounds(self.bounds)
        _check_anchors(self.anchors, self.num_layers)
        unused = set(range(self.num_types)) - set(self.depth_types)
        if unused:
            raise ValueError(f"anchors {[self.anchors[a] for a in sorted(unused)]} are never selected by any "
                             f"depth for stage bounds {list(self.bounds)}; build the plan with AnchorPlan.build")

    @classmethod
    def build(cls, bounds: list[int] | tuple[int, ...],
              anchors: list[int] | tuple[int, ...] | None = None) -> "AnchorPlan":
        """The default anchors for these bounds, or the given ones, validated and pruned."""
        chosen = default_anchors(bounds) if anchors is None else tuple(anchors)
        kept, _ = prune_anchors(bounds, chosen)
        return cls(tuple(bounds), kept)

    @property
    def n(self) -> int:
        """Number of stages, which is also the full depth."""
        return len(self.bounds) - 1

    @property
    def num_layers(self) -> int:
        return self.bounds[-1]

    @property
    def num_types(self) -> int:
        """Number of aggregation types (one projection W_a each), equal to the number of anchors."""
        return len(self.anchors)

    @property
    def depth_types(self) -> tuple[int, ...]:
        """(A(0), .., A(n))."""
        return _depth_types(self.bounds, self.anchors)

    def type_at_depth(self, depth: int) -> int:
        """A(d) = max{a : b_a <= B_d}: the deepest aggregation type computed at depth d."""
        if not 0 <= depth <= self.n:
            raise ValueError(f"depth must be in 0..{self.n}, got {depth}")
        return bisect.bisect_right(self.anchors, self.bounds[depth]) - 1

    def anchor_layer(self, index: int) -> int | None:
        """The layer whose raw output is anchor `index` (None for anchor 0, the embedding output)."""
        value = self.anchors[index]
        return None if value == 0 else value - 1

    def producer_stage(self, index: int) -> int | None:
        """The stage whose layers produce anchor `index`; None for anchor 0 (the driver embeds)."""
        layer = self.anchor_layer(index)
        if layer is None:
            return None
        return bisect.bisect_right(self.bounds, layer) - 1

    def anchors_of_stage(self, stage: int) -> tuple[int, ...]:
        """Indices of the anchors stage `stage` produces (and sends to the driver), ascending."""
        if not 0 <= stage < self.n:
            raise ValueError(f"stage must be in 0..{self.n - 1}, got {stage}")
        return tuple(a for a in range(self.num_types) if self.producer_stage(a) == stage)

    def to_dict(self) -> dict:
        return {"stage_bounds": list(self.bounds), "anchors": list(self.anchors)}

    @classmethod
    def from_dict(cls, d: dict) -> "AnchorPlan":
        if set(d) != {"stage_bounds", "anchors"}:
            raise ValueError(f"anchor plan: expected keys ['anchors', 'stage_bounds'], got {sorted(d)}")
        return cls(tuple(d["stage_bounds"]), tuple(d["anchors"]))

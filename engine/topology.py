"""Topology: how layers map to stages and stages map to ranks. Pure logic, no torch.distributed.

Stage `p` holds layers `[B_p, B_{p+1})`. The default split gives the first `L mod n` stages one
extra layer (30 layers at n=4: 8,8,7,7). Ranks: the driver is rank 0 and stage `p` is rank
`p + 1` (world size n + 1), or, co-located, the driver shares rank 0 with stage 0 (world size n).
"""
from __future__ import annotations

from dataclasses import dataclass


def default_stage_layers(num_layers: int, n: int) -> list[int]:
    """Layer counts per stage: the first `num_layers % n` stages get one extra layer."""
    if n < 1:
        raise ValueError(f"number of stages must be >= 1, got {n}")
    if n > num_layers:
        raise ValueError(f"{n} stages is more than the model's {num_layers} layers")
    base, extra = divmod(num_layers, n)
    return [base + (1 if p < extra else 0) for p in range(n)]


def parse_stage_layers(spec: str | list[int], num_layers: int) -> list[int]:
    """Parse and validate an explicit split like "8,8,7,7" against the model's layer count."""
    if isinstance(spec, str):
        try:
            counts = [int(x) for x in spec.split(",") if x.strip()]
        except ValueError:
            raise ValueError(f"stage layers must be comma-separated integers, got {spec!r}") from None
    else:
        counts = list(spec)
    if not counts:
        raise ValueError("stage layers list is empty")
    if any(c < 1 for c in counts):
        raise ValueError(f"every stage needs at least one layer, got {counts}")
    if sum(counts) != num_layers:
        raise ValueError(f"stage layers {counts} sum to {sum(counts)}, but the model has {num_layers} layers")
    return counts


def stage_bounds(counts: list[int]) -> list[int]:
    """Boundaries B_0=0 .. B_n=L from per-stage layer counts."""
    bounds = [0]
    for c in counts:
        bounds.append(bounds[-1] + c)
    return bounds


@dataclass(frozen=True)
class Topology:
    """Stage split plus rank placement. `bounds[p]..bounds[p+1]` are stage p's layers."""

    stage_layers: tuple[int, ...]
    colocate: bool = False

    def __post_init__(self) -> None:
        if not self.stage_layers or any(c < 1 for c in self.stage_layers):
            raise ValueError(f"invalid stage layers {self.stage_layers}")

    @classmethod
    def build(cls, num_layers: int, n: int | None = None, stage_layers: str | list[int] | None = None,
              colocate: bool = False) -> "Topology":
        if stage_layers is not None:
            counts = parse_stage_layers(stage_layers, num_layers)
            if n is not None and n != len(counts):
                raise ValueError(f"--stages {n} disagrees with the {len(counts)} stage layer counts {counts}")
        else:
            counts = default_stage_layers(num_layers, 1 if n is None else n)
        return cls(tuple(counts), colocate)

    @property
    def n(self) -> int:
        return len(self.stage_layers)

    @property
    def num_layers(self) -> int:
        return sum(self.stage_layers)

    @property
    def bounds(self) -> list[int]:
        return stage_bounds(list(self.stage_layers))

    def layers_of(self, stage: int) -> range:
        b = self.bounds
        return range(b[stage], b[stage + 1])

    @property
    def world_size(self) -> int:
        return self.n if self.colocate else self.n + 1

    @property
    def driver_rank(self) -> int:
        return 0

    def stage_rank(self, stage: int) -> int:
        assert 0 <= stage < self.n
        return stage if self.colocate else stage + 1

    def stage_of_rank(self, rank: int) -> int | None:
        """The stage a rank runs, or None for a driver-only rank."""
        stage = rank if self.colocate else rank - 1
        return stage if 0 <= stage < self.n else None

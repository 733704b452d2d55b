"""Topology: how layers map to stages and stages map to ranks. Pure logic, no torch.distributed.

Stage `p` holds layers `[B_p, B_{p+1})`. The default split gives the first `L mod n` stages one
extra layer (30 layers at n=4: 8,8,7,7). Ranks: the driver is rank 0 and stage `p` is rank
`p + 1` (world size n + 1), or, co-located, the driver shares rank 0 with stage 0 (world size n).
With tensor parallelism (`tp` = T > 1) stage `p` runs on T ranks, TP rank `t` of stage `p` being
global rank `base + p T + t` (base 1 with a separate driver, else 0): world size n T (+ 1).
`stage_rank(p)` is TP rank 0 of the stage, the one that talks to the driver (docs/design.md 3.9).
"""
from __future__ import annotations

from dataclasses import dataclass

# where SPD computes T=0 verification's argmax (RunConfig.parallel.verify_at, docs/design.md 3.5)
VERIFY_AT = ("auto", "last", "driver")


def verifies_on_last(verify_at: str, colocate: bool) -> bool:
    """Whether the last stage runs T=0 verification's head (at n >= 2): "last", or "auto" when the
    driver shares rank 0 with stage 0 (its rank is then the busiest); "driver", and "auto" with a
    rank of its own, keep the head on the driver. The runtime (RunConfig.verifies_on_last) and the
    cost model (costmodel/cost_model_spd.py) decide by this one rule."""
    if verify_at not in VERIFY_AT:
        raise ValueError(f"verify_at must be one of {VERIFY_AT}, got {verify_at!r}")
    return verify_at == "last" or (verify_at == "auto" and colocate)


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
    tp: int = 1  # ranks per stage (tensor parallel)

    def __post_init__(self) -> None:
        if not self.stage_layers or any(c < 1 for c in self.stage_layers):
            raise ValueError(f"invalid stage layers {self.stage_layers}")
        if isinstance(self.tp, bool) or not isinstance(self.tp, int) or self.tp < 1:
            raise ValueError(f"--tp must be an integer >= 1, got {self.tp!r}")

    @classmethod
    def build(cls, num_layers: int, n: int | None = None, stage_layers: str | list[int] | None = None,
              colocate: bool = False, tp: int = 1) -> "Topology":
        if stage_layers is not None:
            counts = parse_stage_layers(stage_layers, num_layers)
            if n is not None and n != len(counts):
                raise ValueError(f"--stages {n} disagrees with the {len(counts)} stage layer counts {counts}")
        else:
            counts = default_stage_layers(num_layers, 1 if n is None else n)
        return cls(tuple(counts), colocate, tp)

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
        return self.n * self.tp + (0 if self.colocate else 1)

    @property
    def driver_rank(self) -> int:
        return 0

    @property
    def _base(self) -> int:
        return 0 if self.colocate else 1

    def stage_rank(self, stage: int, tp_rank: int = 0) -> int:
        """Global rank of TP rank `tp_rank` of `stage` (TP rank 0 talks to the driver)."""
        assert 0 <= stage < self.n and 0 <= tp_rank < self.tp, (stage, tp_rank)
        return self._base + stage * self.tp + tp_rank

    def stage_ranks(self, stage: int) -> tuple[int, ...]:
        """The stage's TP group, in TP-rank order."""
        return tuple(self.stage_rank(stage, t) for t in range(self.tp))

    def place_of_rank(self, rank: int) -> tuple[int, int] | None:
        """(stage, TP rank) a rank runs, or None for a driver-only rank."""
        local = rank - self._base
        if not 0 <= local < self.n * self.tp:
            return None
        return divmod(local, self.tp)

    def stage_of_rank(self, rank: int) -> int | None:
        """The stage a rank runs, or None for a driver-only rank."""
        place = self.place_of_rank(rank)
        return None if place is None else place[0]

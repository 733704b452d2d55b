"""Stage splits for the cost model: the engine's default split (engine/protocol/topology.py
default_stage_layers) is the even one; `balanced_partition` is the contiguous split that
minimises the slowest stage, and `stage_times` turns a split into per-stage compute;
`rebalanced_split` applies it to a run's measured per-tick costs (`spd bench`). Pure arithmetic:
no torch. Times are milliseconds.
"""
from __future__ import annotations

from spd_engine.costmodel.cost_inputs import Profile


def balanced_partition(layer_ms: tuple[float, ...], n: int, extra_ms: list[float]) -> list[int]:
    """Contiguous split minimising max_p(stage time + extra_p), e.g. extra_0 = driver work when
    the driver shares stage 0's device; among the splits reaching that maximum, the one with
    the smallest sum of squares (the most even). Two dynamic programmes over prefix sums."""
    num_layers = len(layer_ms)
    if not 1 <= n <= num_layers:
        raise ValueError(f"cannot split {num_layers} layers into {n} stages")
    prefix = [0.0]
    for t in layer_ms:
        prefix.append(prefix[-1] + t)

    def solve(cost, combine, limit: float) -> tuple[float, list[int]]:
        inf = float("inf")
        best = [[inf] * (num_layers + 1) for _ in range(n + 1)]
        cut = [[0] * (num_layers + 1) for _ in range(n + 1)]
        best[0][0] = 0.0
        for p in range(1, n + 1):
            for i in range(p, num_layers - (n - p) + 1):  # stage p-1 ends after layer i-1
                for j in range(p - 1, i):
                    stage = prefix[i] - prefix[j] + extra_ms[p - 1]
                    if stage > limit or best[p - 1][j] == inf:
                        continue
                    value = combine(best[p - 1][j], cost(stage))
                    if value < best[p][i]:
                        best[p][i], cut[p][i] = value, j
        counts, i = [], num_layers
        for p in range(n, 0, -1):
            counts.append(i - cut[p][i])
            i = cut[p][i]
        return best[n][num_layers], counts[::-1]

    worst, _ = solve(lambda x: x, max, float("inf"))
    _, counts = solve(lambda x: x * x, lambda a, b: a + b, worst * (1 + 1e-9) + 1e-12)
    return counts


def stage_times(profile: Profile, counts: list[int], shard_layer_ms: tuple[float, ...] | None = None,
                per_layer_extra_ms: float = 0.0) -> list[float]:
    """Per-stage compute: the stage's layers (or their TP shards) + per-layer all-reduces + fixed cost."""
    layers = shard_layer_ms or profile.layer_ms
    out, start = [], 0
    for c in counts:
        out.append(sum(layers[start:start + c]) + c * per_layer_extra_ms + profile.stage_fixed_ms)
        start += c
    return out


def rebalanced_split(counts: list[int], layers_ms: list[float], extra_ms: list[float]) -> tuple[list[int], float, float]:
    """A run's split rebalanced from its own measured costs: `layers_ms[p]`, stage p's layers
    together (each layer charged its stage's mean), `extra_ms[p]`, the rest of that rank's work
    per tick (the co-located driver's PDM, a verifying last stage's head). Returns (the balanced
    split, its predicted busiest rank, the measured split's busiest), all in ms."""
    if not (len(counts) == len(layers_ms) == len(extra_ms)) or min(counts, default=0) < 1:
        raise ValueError(f"split {counts}: need one layer time and one extra per stage, each stage >= 1 layer")
    per_layer = tuple(t / c for t, c in zip(layers_ms, counts) for _ in range(c))

    def busiest(split: list[int]) -> float:
        out, start = [], 0
        for c, e in zip(split, extra_ms):
            out.append(sum(per_layer[start:start + c]) + e)
            start += c
        return max(out)

    best, now = balanced_partition(per_layer, len(counts), list(extra_ms)), busiest(list(counts))
    if busiest(best) >= now - 1e-9:  # no better than the run's own split: keep it
        best = list(counts)
    return best, busiest(best), now

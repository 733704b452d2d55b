"""Stage splits for the cost model: the engine's default split (engine/protocol/topology.py
default_stage_layers) is the even one; `balanced_partition` is the contiguous split that
minimises the slowest stage, and `stage_times` turns a split into per-stage compute. Pure
arithmetic: no torch. Times are milliseconds.
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

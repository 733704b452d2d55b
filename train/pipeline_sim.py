"""Exact pipeline simulation for PDM training and teacher-forced evaluation (docs/design.md 3.7).

At a tick whose newest position is `t` with fill `f` (in-flight tokens at lags 0..f-1), the
token at position `x` is seen at depth `D_f(t - x)`, with `D_f(l) = l if l < f else n`. With
K >= 2 PDM layers every key's own hidden state depends on the depths *it* saw when computed,
so one causal stack over per-position rows is not exact. The exact construction: one S-row block
per depth d in {0..f-1, n}; row (d, T) = W_{A(d)} . anchors(T)[0..A(d)] at RoPE position T, and
row (d, T) attends to row (d', T') iff T' <= T and d' = D_f(d + T - T'). Block 0's output at T is
the draft the runtime makes for position T + 1 when T is the newest token of a tick with fill f.
"""
from __future__ import annotations

import torch

from spd_engine.engine.model.pdm import PDM
from spd_engine.engine.protocol.anchors import AnchorPlan


def block_depths(n: int, f: int) -> list[int]:
    """Depths that get a block: 0..f-1 (in flight) and n (full)."""
    if not 1 <= f <= n:
        raise ValueError(f"fill must be in 1..{n}, got {f}")
    return list(range(f)) + [n]


def depth_after(n: int, f: int, lag: torch.Tensor) -> torch.Tensor:
    """D_f(lag) elementwise."""
    return torch.where(lag < f, lag, torch.full_like(lag, n))


def simulation_mask(S: int, n: int, f: int, device=None) -> torch.Tensor:
    """Bool mask [nb*S, nb*S] over rows ordered block by block (block order = block_depths)."""
    depths = torch.tensor(block_depths(n, f), device=device)  # [nb]
    nb = depths.numel()
    pos = torch.arange(S, device=device)
    q_d = depths.repeat_interleave(S)  # [nb*S] depth of each query row
    q_t = pos.repeat(nb)  # [nb*S] position of each row
    lag = q_d[:, None] + q_t[:, None] - q_t[None, :]  # d + T - T'
    want = depth_after(n, f, lag.clamp(min=0))
    return (q_t[None, :] <= q_t[:, None]) & (q_d[None, :] == want)


def simulation_rows(pdm: PDM, anchors: torch.Tensor, f: int) -> torch.Tensor:
    """anchors [B, S, m, H] -> rows [B, nb*S, H], block by block."""
    plan: AnchorPlan = pdm.plan
    blocks = [pdm.rows_of_type(anchors, plan.type_at_depth(d)) for d in block_depths(plan.n, f)]
    return torch.cat(blocks, dim=1)


def simulated_hidden(pdm: PDM, anchors: torch.Tensor, f: int) -> torch.Tensor:
    """PDM hidden states of block 0 [B, S, H]: the newest-token outputs at fill f."""
    B, S = anchors.shape[:2]
    n = pdm.plan.n
    rows = simulation_rows(pdm, anchors, f)  # [B, nb*S, H]
    nb = rows.shape[1] // S
    mask = simulation_mask(S, n, f, anchors.device)[None, None]  # [1, 1, nbS, nbS]
    positions = torch.arange(S, device=anchors.device).repeat(nb).expand(B, nb * S)
    cache = pdm.new_cache(nb * S, batch=B)
    h = pdm.forward_rows(rows, cache, 0, positions=positions, mask=mask)
    return h[:, :S]


def anchor_layers(plan: AnchorPlan) -> list[int | None]:
    """Target layer whose output is each anchor (None: the embedding output)."""
    return [plan.anchor_layer(a) for a in range(plan.num_types)]


@torch.no_grad()
def target_anchors(target, plan: AnchorPlan, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher forward of the full target over tokens [B, S]: anchors [B, S, m, H] and final hidden [B, S, H]."""
    B, S = tokens.shape
    layers = anchor_layers(plan)
    cache = target.new_cache(B, S)
    emb = target.embed(tokens)
    h, caps = target.forward_layers(emb, cache, 0, capture=frozenset(x for x in layers if x is not None))
    anchors = torch.stack([emb if x is None else caps[x] for x in layers], dim=2)
    return anchors, h

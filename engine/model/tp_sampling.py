"""The next token of a vocab-parallel head, chosen across the TP ranks without gathering the
full logits. Pure logic over a `TPGroup` (engine/comm/tp_group.py), no torch.distributed import.

Each rank holds the logits of its vocabulary shard `[lo, lo + V/T)` (fp32):
- greedy: each rank's max and its (first) index, one all_gather of T (value, id) pairs; the
  largest value wins and a tie goes to the lowest id, as `torch.argmax` on the full logits does
  (a step of R rows: one all_gather of T x R pairs, `tp_argmax_rows`);
- T > 0 (engine/protocol/sampling.py semantics: temperature, then top-k, then top-p; one keyed uniform
  inverts the float64 CDF): top-k gathers each rank's k largest values (T k floats) to find the
  global k-th; the CDF is inverted across shards from the shard totals (one all_gather of T
  floats), and the rank where `u * total` falls inverts its own CDF; its id reaches all ranks
  in a last all_gather. Every rank computes the same draw (same key, same gathered numbers).
  top-p < 1 needs the sorted head of the whole distribution, so that one filter gathers the
  shard logits (V floats per token) and applies `target_probs` / `sample` to the full vector.
"""
from __future__ import annotations

import math

import torch

from spd_engine.engine.comm.tp_group import TPGroup
from spd_engine.engine.protocol.sampling import SamplingParams, keyed_generator, sample, target_probs, uniform


def tp_argmax(group: TPGroup, local: torch.Tensor, lo: int) -> int:
    """argmax over the full vocabulary of local [V/T] shard logits (ties: lowest id)."""
    local = local.detach()
    i = int(local.argmax())
    pair = torch.tensor([float(local[i]), float(lo + i)], dtype=torch.float64)  # fp32 values and ids are exact
    table = torch.stack(group.all_gather(pair)).tolist()  # [T, 2], ranks in vocabulary order
    best = max(range(len(table)), key=lambda r: (table[r][0], -r))  # first rank holding the max
    return int(table[best][1])


def tp_argmax_rows(group: TPGroup, local: torch.Tensor, lo: int) -> torch.Tensor:
    """Each row's tp_argmax at once: local [R, V/T] shard logits -> ids [R] (int64, on the host), one
    all_gather of R (value, id) pairs per rank for the whole step."""
    local = local.detach()
    i = local.argmax(-1)  # [R]: the first maximum of each row
    # on the logits' device, as the layers' reductions: fp32 values and ids are exact in float64
    pairs = torch.stack([local.gather(-1, i[:, None])[:, 0].double(), (i + lo).double()], dim=-1)  # [R, 2]
    table = torch.stack(group.all_gather(pairs))  # [T, R, 2], ranks in vocabulary order
    best = table[..., 0].argmax(0)  # [R]: the first rank holding the row's maximum
    return table[best, torch.arange(len(best), device=best.device), 1].long().cpu()  # host sync: ids go in the table


def _global_kth(group: TPGroup, x: torch.Tensor, k: int) -> float:
    """The k-th largest of the scaled logits over all shards."""
    local = torch.full((k,), -math.inf, dtype=torch.float32)
    m = min(k, x.numel())
    local[:m] = torch.topk(x, m).values
    return float(torch.topk(torch.cat(group.all_gather(local)), k).values[-1])


def tp_sample(group: TPGroup, local: torch.Tensor, lo: int, vocab: int, params: SamplingParams, pos: int) -> int:
    """A draw from target_probs(full logits) keyed by (seed, pos, "target"), across shards."""
    if params.greedy:
        return tp_argmax(group, local, lo)
    gen = keyed_generator(params.seed, pos, "target")
    if params.top_p < 1.0:  # needs the whole sorted distribution: gather the shard logits
        return sample(target_probs(torch.cat(group.all_gather(local.float())), params), gen)
    x = local.float() / params.temperature  # [V/T]
    if params.top_k > 0:
        kth = _global_kth(group, x, min(params.top_k, vocab))
        x = x.masked_fill(x < kth, -math.inf)  # keeps every token tied with the k-th, as target_probs
    stats = torch.stack([x.max().double(), torch.zeros((), dtype=torch.float64)])
    peak = max(row[0] for row in torch.stack(group.all_gather(stats)).tolist())
    weights = torch.exp(x.double() - peak)  # [V/T] float64, the softmax numerators
    totals = torch.stack(group.all_gather(weights.sum().view(1))).view(-1)  # [T] float64
    cum = torch.cumsum(totals, 0)
    target = uniform(gen) * float(cum[-1])
    owner = min(int(torch.searchsorted(cum, torch.tensor([target], dtype=torch.float64), right=True)),
                len(totals) - 1)
    while float(totals[owner]) == 0:  # u * total rounded onto the end: the last shard with weight
        owner -= 1
    token = -1.0
    if group.rank == owner:
        below = float(cum[owner - 1]) if owner > 0 else 0.0
        lcdf = torch.cumsum(weights, 0)
        i = int(torch.searchsorted(lcdf, torch.tensor([target - below], dtype=torch.float64), right=True))
        if i >= weights.numel() or weights[i] == 0:  # rounding past the shard's last weighted token
            i = int(torch.nonzero(weights).max())
        token = float(lo + i)
    ids = torch.stack(group.all_gather(torch.tensor([token], dtype=torch.float64))).view(-1)
    return int(ids[owner])

"""Comparisons of two computations of the same logits that differ in the last bits (another kernel,
another reduction order, another thread count): within a bound, and argmax / greedy agreement
except at near-ties.

If every logit of `got` is within `bound` of `want`, the argmax of `got` can only differ from the
argmax of `want` where the top two logits of `want` are within `2 * bound` of each other: a
near-tie. Greedy decoding only compares argmaxes, so two greedy decoders within `bound` of each
other give the same tokens up to the first near-tie and may part there (after that their inputs
differ and nothing more is claimed). Counted, never hidden: the tests print the near-ties they met.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


def top2_margin(logits: torch.Tensor) -> torch.Tensor:
    """logits [..., V] -> top-1 minus top-2 logit [...]."""
    top = logits.float().topk(2, dim=-1).values
    return top[..., 0] - top[..., 1]


def count_near_ties(logits: torch.Tensor, bound: float) -> int:
    """Positions of logits [T, V] whose top two are within 2 * bound: where another computation
    within `bound` could pick the other token."""
    return int((top2_margin(logits) <= 2 * bound).sum())


def assert_close_and_argmax_agrees(got: torch.Tensor, want: torch.Tensor, bound: float, what: str = "") -> int:
    """got, want logits [T, V]: every logit within `bound`, and the argmax equal at every position
    that is not a near-tie of `want`. Returns the number of near-ties (where the argmax may differ)."""
    diff = (got.float() - want.float()).abs().max().item()
    assert diff <= bound, f"{what}: max |logit diff| {diff:.3g} > {bound:g}"
    clear = top2_margin(want) > 2 * bound  # [T]
    differs = got.argmax(-1) != want.argmax(-1)
    assert not (differs & clear).any(), f"{what}: argmax differs at positions {(differs & clear).nonzero().flatten().tolist()}"
    return int((~clear).sum())


def first_difference(got: Sequence[int], want: Sequence[int]) -> int | None:
    """Index of the first token where two outputs differ (a length difference counts), else None."""
    for k, (a, b) in enumerate(zip(got, want)):
        if a != b:
            return k
    return None if len(got) == len(want) else min(len(got), len(want))


def assert_greedy_agrees(got: Sequence[int], want: Sequence[int], logits_at: Callable[[int], torch.Tensor],
                         bound: float, what: str = "") -> int | None:
    """Two greedy outputs agree, or first differ at a near-tie.

    `logits_at(k)` gives the logits [V] of the position that produced token `k` after the common
    prefix `want[:k]`, from a computation within `bound` of both decoders (e.g. the reference
    model teacher-forced over `prompt + want`). At a real divergence both decoders' tokens must be
    within 2 * bound there. Returns the index of the divergence, None when the outputs are equal.
    """
    k = first_difference(got, want)
    if k is None:
        return None
    assert k < len(got) and k < len(want), f"{what}: one output stops at {k} (an EOS) and the other does not"
    logits = logits_at(k).float()
    gap = abs(logits[got[k]].item() - logits[want[k]].item())
    assert gap <= 2 * bound, (f"{what}: outputs differ at token {k} ({got[k]} vs {want[k]}), "
                              f"not a near-tie: their logits are {gap:.3g} apart (bound {2 * bound:g})")
    return k


@torch.no_grad()
def teacher_forced(model, prompt: Sequence[int], tokens: Sequence[int]) -> Callable[[int], torch.Tensor]:
    """`logits_at` for `assert_greedy_agrees`: the logits [V] that chose tokens[k], from one forward
    of a full `StageModel` over prompt + tokens."""
    ids = torch.tensor([list(prompt) + list(tokens)])
    h, _ = model.forward_layers(model.embed(ids), model.new_cache(1, ids.shape[1]), 0)
    logits = model.logits(h)[0]  # [T, V]
    return lambda k: logits[len(prompt) - 1 + k]

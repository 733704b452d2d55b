"""Verification rule: accept or correct one draft. Pure logic, no torch.distributed.

At T=0 a draft is accepted iff it equals the target's argmax, and the argmax is the
correction otherwise. At T>0 this is speculative sampling (Leviathan et al. 2023): with `p`
the target distribution of the position (engine.sampling.target_probs) and `q` the exact
distribution the draft was sampled from, the committed token is distributed exactly as `p`.
"""
from __future__ import annotations

import torch

from spd_engine.engine.protocol.sampling import sample, uniform


def verify_greedy(target: torch.Tensor | int, draft: int) -> tuple[bool, int]:
    """(accepted, committed token) from target logits [V] (or their argmax id) and a draft id.

    The committed token is the target's argmax either way: the draft when accepted, the
    correction otherwise. Ties go to the lowest id, as torch.argmax.
    """
    if isinstance(target, torch.Tensor):
        assert target.dim() == 1, f"verify_greedy expects logits [V], got {tuple(target.shape)}"
        target = int(torch.argmax(target))
    return target == draft, target


def verify_sampled(p: torch.Tensor, q: torch.Tensor, draft: int, accept_gen: torch.Generator,
                   residual_gen: torch.Generator) -> tuple[bool, int]:
    """(accepted, committed token) for a draft sampled from q, against the target distribution p.

    p, q: [V] fp32 distributions over the full vocabulary (q is zero outside a draft vocabulary).
    accept_gen / residual_gen: the keyed generators of this position's "accept" and "residual"
    draws (engine.sampling.keyed_generator); the residual draw is made only on rejection.
    """
    assert p.dtype == torch.float32 and q.dtype == torch.float32, (p.dtype, q.dtype)
    assert p.dim() == 1 and p.shape == q.shape, (tuple(p.shape), tuple(q.shape))
    assert 0 <= draft < p.shape[0], f"draft id {draft} outside a vocabulary of {p.shape[0]}"
    px, qx = torch.stack([p[draft], q[draft]]).tolist()
    # The draft was drawn from q, so q(x) > 0; q(x) = 0 means q is not the draft's distribution.
    assert qx > 0, f"draft {draft} has q(x) = {qx}: q is not the distribution it was sampled from"

    # Accept with probability min(1, p(x)/q(x)): for u ~ U[0,1), P(u < p/q) = min(1, p/q).
    # Written as u*q(x) < p(x) to avoid the division; p(x) >= q(x) always accepts since u < 1,
    # and p(x) = 0 never does.
    if uniform(accept_gen) * qx < px:
        return True, draft

    # Reject: sample from the residual r = norm(max(p - q, 0)). Then for every token y
    #   P(y) = q(y) min(1, p(y)/q(y)) + P(reject) r(y) = min(p(y), q(y)) + max(p(y) - q(y), 0) = p(y),
    # since P(reject) = 1 - sum_y min(p, q) = sum_y max(p - q, 0) is exactly r's normaliser.
    residual = torch.clamp(p - q, min=0.0)  # [V] fp32
    mass = float(residual.sum())
    # Zero mass means p <= q everywhere (p == q up to rounding, or p not normalised): the
    # rule has nothing to correct towards, so fall back to p itself.
    if not mass > 0:
        return False, sample(p, residual_gen)
    return False, sample(residual / mass, residual_gen)

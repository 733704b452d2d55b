"""Verification of several candidates for one position (branch width W, docs/design.md 3.11):
recursive rejection sampling. Pure logic, no torch.distributed.

Candidates x_1..x_k of one position come in a fixed order; x_i was drawn from q_i given
x_1..x_{i-1} (a candidate chosen deterministically, a suffix draft or "the PDM's j-th best",
has the point mass on it as its q). With r_1 = p, the target distribution:
  accept x_i with probability min(1, r_i(x_i) / q_i(x_i)); else r_{i+1} = norm(max(r_i - q_i, 0));
  when all k are rejected, draw from r_{k+1}.
By the single-draft argument (engine/protocol/verify.py) applied at every step, the token committed
from step i on is distributed as r_i given x_<i, so the committed token is distributed exactly
as p (SpecInfer's and SpecTr's multi-draft rule). `committed_distribution` is the same
recursion without draws: the exact law of the committed token given the candidates, which the
tests sum over every candidate draw to recover p.

Draws stay keyed (engine/protocol/sampling.py): candidate i's acceptance is the i-th uniform of the
position's "accept" generator, so one candidate uses the very draw engine/protocol/verify.py uses.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from spd_engine.engine.protocol.sampling import sample, uniform


@dataclass(frozen=True)
class Candidate:
    token: int
    q: torch.Tensor | None = None  # [V] fp32, what the token was drawn from; None: the point mass on it

    def q_of(self, like: torch.Tensor) -> torch.Tensor:
        if self.q is not None:
            return self.q
        point = torch.zeros_like(like)  # [V]
        point[self.token] = 1.0
        return point


def _residual(r: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(r - q, 0)); r itself when that has no mass (r <= q everywhere: r == q up to
    rounding, and a rejection then had probability zero)."""
    res = torch.clamp(r - q, min=0.0)  # [V]
    mass = float(res.sum())
    return res / mass if mass > 0 else r


def _steps(p: torch.Tensor, candidates: Sequence[Candidate]):
    """(x_i, r_i, q_i, acceptance probability) for every candidate, and r_{k+1} last."""
    assert p.dtype == torch.float32 and p.dim() == 1, (p.dtype, tuple(p.shape))
    r, out = p, []
    for c in candidates:
        assert 0 <= c.token < p.shape[0], f"candidate {c.token} outside a vocabulary of {p.shape[0]}"
        q = c.q_of(p)
        assert q.shape == p.shape and q.dtype == torch.float32, (tuple(q.shape), q.dtype)
        rx, qx = torch.stack([r[c.token], q[c.token]]).tolist()
        assert qx > 0, f"candidate {c.token} has q(x) = {qx}: q is not the distribution it was drawn from"
        out.append((c.token, r, q, min(1.0, rx / qx)))
        r = _residual(r, q)
    return out, r


def committed_distribution(p: torch.Tensor, candidates: Sequence[Candidate]) -> torch.Tensor:
    """The exact distribution [V] (fp64) of the committed token given these candidates."""
    steps, last = _steps(p, candidates)
    dist = torch.zeros(p.shape[0], dtype=torch.float64)
    reach = 1.0
    for token, _, _, a in steps:
        dist[token] += reach * a
        reach *= 1.0 - a
    return dist + reach * last.to(torch.float64)


def verify_candidates(p: torch.Tensor, candidates: Sequence[Candidate], accept_gen: torch.Generator,
                      residual_gen: torch.Generator) -> tuple[int | None, int]:
    """(index of the accepted candidate or None, committed token); draws as in the module doc."""
    assert candidates, "at least one candidate"
    r = p
    for i, c in enumerate(candidates):
        q = c.q_of(p)
        rx, qx = torch.stack([r[c.token], q[c.token]]).tolist()
        assert qx > 0, f"candidate {c.token} has q(x) = {qx}: q is not the distribution it was drawn from"
        if uniform(accept_gen) * qx < rx:  # probability min(1, r(x)/q(x)), as engine/protocol/verify.py
            return i, c.token
        r = _residual(r, q)
    return None, sample(r, residual_gen)


def verify_candidates_greedy(argmax: int, candidates: Sequence[int]) -> tuple[int | None, int]:
    """T=0: the candidate equal to the target's argmax survives (None: the argmax is the correction)."""
    return next((i for i, t in enumerate(candidates) if t == argmax), None), argmax

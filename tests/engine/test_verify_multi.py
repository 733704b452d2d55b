"""Several candidates for one position (engine/protocol/verify_multi.py): the committed token is distributed
exactly as the target's p, summed over every way the candidates can be drawn; the check is shown to
fail two broken rules; the keyed sampler follows the exact law; one candidate is engine/protocol/verify.py."""
from __future__ import annotations

import itertools

import pytest
import torch
from stats import TEST_LEVEL, chi_square_pvalue

from spd_engine.engine.protocol.sampling import keyed_generator
from spd_engine.engine.protocol.verify import verify_sampled
from spd_engine.engine.protocol.verify_multi import Candidate, committed_distribution, verify_candidates, verify_candidates_greedy

pytestmark = pytest.mark.pure  # the fast tier: logic only, no process, no model file

V = 5


def dist(seed: int, zero: tuple[int, ...] = ()) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(V, generator=g, dtype=torch.float64) + 0.05
    x[list(zero)] = 0.0
    return (x / x.sum()).float()


def without(q: torch.Tensor, token: int) -> torch.Tensor:
    r = q.clone()
    r[token] = 0.0
    return r / r.sum()


def schemes(q: torch.Tensor):
    """name -> every (probability, candidates) of one way of drawing two or three candidates."""
    yield "iid", [(float(q[a] * q[b]), [Candidate(a, q), Candidate(b, q)]) for a in range(V) for b in range(V)]
    yield "without-replacement", [(float(q[a] * without(q, a)[b]), [Candidate(a, q), Candidate(b, without(q, a))])
                                  for a in range(V) for b in range(V) if a != b]
    yield "suffix-then-pdm", [(float(q[b]), [Candidate(3), Candidate(b, q)]) for b in range(V)]
    yield "pdm-top-2-ranked", [(1.0, [Candidate(int(i)) for i in q.topk(2).indices])]
    yield "three-iid", [(float(q[a] * q[b] * q[c]), [Candidate(a, q), Candidate(b, q), Candidate(c, q)])
                        for a, b, c in itertools.product(range(V), repeat=3)]


def total(law, draws) -> torch.Tensor:
    out = torch.zeros(V, dtype=torch.float64)
    for prob, cands in draws:
        if prob > 0:
            out += prob * law(cands)
    return out


@pytest.mark.parametrize("p_seed,q_seed", [(0, 1), (2, 3), (4, 4)])
def test_the_committed_token_is_distributed_as_p(p_seed, q_seed):
    p, q = dist(p_seed, zero=(1,)), dist(q_seed)  # p has a zero: a token the target never emits
    for name, draws in schemes(q):
        got = total(lambda c: committed_distribution(p, c), draws)
        assert torch.allclose(got, p.double(), atol=1e-6), (name, got, p)


def broken_no_residual(p, cands):
    """Every candidate checked against p itself: the second chance double-counts tokens."""
    out, reach = torch.zeros(V, dtype=torch.float64), 1.0
    for c in cands:
        q = c.q_of(p)
        a = min(1.0, float(p[c.token] / q[c.token]))
        out[c.token] += reach * a
        reach *= 1 - a
    return out + reach * p.double()


def test_the_check_catches_broken_rules():
    p, q = dist(0, zero=(1,)), dist(1)
    draws = dict(schemes(q))
    no_residual = total(lambda c: broken_no_residual(p, c), draws["iid"])
    assert (no_residual - p.double()).abs().max() > 0.01
    # the second candidate drawn without replacement, but verified as if drawn from q
    stale_q = [(w, [c[0], Candidate(c[1].token, q)]) for w, c in draws["without-replacement"]]
    wrong = total(lambda c: committed_distribution(p, c), stale_q)
    assert (wrong - p.double()).abs().max() > 0.01


def test_the_keyed_sampler_follows_the_exact_law():
    p, q = dist(5), dist(6)
    cands = [Candidate(2, q), Candidate(0, without(q, 2)), Candidate(4)]
    law = committed_distribution(p, cands).numpy()
    counts = [0] * V
    for seed in range(4000):
        i, tok = verify_candidates(p, cands, keyed_generator(seed, 7, "accept"), keyed_generator(seed, 7, "residual"))
        assert i is None or cands[i].token == tok
        counts[tok] += 1
    assert chi_square_pvalue(counts, law) > TEST_LEVEL


def test_one_candidate_is_the_single_draft_rule():
    p, q = dist(7), dist(8)
    for seed in range(200):
        draft = int(torch.multinomial(q, 1, generator=torch.Generator().manual_seed(seed)))
        one = verify_candidates(p, [Candidate(draft, q)], keyed_generator(seed, 3, "accept"),
                                keyed_generator(seed, 3, "residual"))
        ref = verify_sampled(p, q, draft, keyed_generator(seed, 3, "accept"), keyed_generator(seed, 3, "residual"))
        assert (one[0] == 0, one[1]) == ref


def test_greedy_and_bad_candidates():
    assert verify_candidates_greedy(7, [3, 7, 9]) == (1, 7)
    assert verify_candidates_greedy(5, [3, 7]) == (None, 5)
    p, q = dist(0), dist(1, zero=(2,))
    with pytest.raises(AssertionError, match="q is not the distribution"):
        committed_distribution(p, [Candidate(2, q)])

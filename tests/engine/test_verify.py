"""Verification rule: greedy, and speculative sampling checked on hand-built p, q tables by
many keyed draws (acceptance probability, residual distribution, output distribution)."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from stats import TEST_LEVEL, chi_square_pvalue, tv_distance

from spd_engine.engine.protocol.sampling import SamplingParams, keyed_generator, sample, target_probs, uniform
from spd_engine.engine.protocol.verify import verify_greedy, verify_sampled

pytestmark = pytest.mark.pure  # the fast tier: logic only, no process, no model file

# token 3 has q = 0 (reachable only through the residual), token 8 has p = 0 (never accepted)
P = torch.tensor([0.30, 0.20, 0.15, 0.12, 0.10, 0.07, 0.04, 0.02, 0.00])
Q = torch.tensor([0.10, 0.25, 0.15, 0.00, 0.20, 0.05, 0.10, 0.05, 0.10])
DRAWS = 40000
SEED = 2024


def verify_at(p: torch.Tensor, q: torch.Tensor, draft: int, position: int, seed: int = SEED):
    return verify_sampled(p, q, draft, keyed_generator(seed, position, "accept"),
                          keyed_generator(seed, position, "residual"))


@pytest.fixture(scope="module")
def runs() -> np.ndarray:
    """[DRAWS, 3]: draft, accepted, committed token; the draft drawn from Q with the draft key."""
    out = []
    for position in range(DRAWS):
        draft = sample(Q, keyed_generator(SEED, position, "draft"))
        accepted, token = verify_at(P, Q, draft, position)
        out.append((draft, accepted, token))
    return np.array(out, dtype=np.int64)


def binomial_z(successes: int, trials: int, prob: float) -> float:
    return (successes - trials * prob) / math.sqrt(trials * prob * (1 - prob))


def test_output_distribution_is_p(runs):
    counts = np.bincount(runs[:, 2], minlength=9)
    assert counts[8] == 0  # p = 0: never emitted
    assert chi_square_pvalue(counts, P.numpy()) > TEST_LEVEL
    assert tv_distance(counts, P.numpy()) < 0.01


def test_acceptance_rate_is_one_minus_tv(runs):
    expected = float(torch.minimum(P, Q).sum())  # sum_x q(x) min(1, p(x)/q(x))
    assert abs(binomial_z(int(runs[:, 1].sum()), DRAWS, expected)) < 4


def test_acceptance_probability_per_draft(runs):
    for x in range(9):
        mine = runs[runs[:, 0] == x]
        if x == 3:
            assert len(mine) == 0  # q(3) = 0: never drafted
            continue
        prob = min(1.0, float(P[x] / Q[x]))
        accepted = int(mine[:, 1].sum())
        if prob in (0.0, 1.0):
            assert accepted == prob * len(mine), x
        else:
            assert abs(binomial_z(accepted, len(mine), prob)) < 4, x
    assert (runs[runs[:, 1] == 1, 2] == runs[runs[:, 1] == 1, 0]).all()  # accepted: the draft is emitted


def test_rejections_sample_the_residual(runs):
    residual = torch.clamp(P - Q, min=0)
    residual = (residual / residual.sum()).numpy()  # mass on tokens 0, 3, 5
    counts = np.bincount(runs[runs[:, 1] == 0, 2], minlength=9)
    assert counts[residual == 0].sum() == 0
    assert chi_square_pvalue(counts, residual) > TEST_LEVEL


def test_accept_rule_is_u_times_q_below_p():
    """The decision equals u*q(x) < p(x) for the uniform of the same key, draft by draft."""
    for position in range(2000):
        draft = position % 9
        if Q[draft] == 0:
            continue
        u = uniform(keyed_generator(SEED, position, "accept"))
        accepted, token = verify_at(P, Q, draft, position)
        assert accepted == (u * float(Q[draft]) < float(P[draft]))
        if accepted:
            assert token == draft


def test_same_key_same_verdict():
    assert [verify_at(P, Q, 4, pos) for pos in range(50)] == [verify_at(P, Q, 4, pos) for pos in range(50)]
    assert [verify_at(P, Q, 4, pos) for pos in range(50)] != [verify_at(P, Q, 4, pos, seed=1) for pos in range(50)]


def test_p_equal_q_always_accepts_and_p_zero_never():
    for position in range(300):
        assert verify_at(Q, Q, position % 3, position) == (True, position % 3)
        accepted, token = verify_at(P, Q, 8, position)
        assert not accepted and token in (0, 3, 5)


def test_zero_residual_falls_back_to_p():
    p = Q * 0.5  # p <= q everywhere: nothing to correct towards
    rejected = 0
    for position in range(400):
        accepted, token = verify_at(p, Q, 1, position)
        if not accepted:
            rejected += 1
            assert token == sample(p, keyed_generator(SEED, position, "residual"))
    assert 150 < rejected < 250  # accept probability p(1)/q(1) = 0.5


def test_one_hot_p_reduces_to_greedy():
    """At T=0 the target distribution is one-hot, and the sampled rule is the greedy rule."""
    gen = torch.Generator().manual_seed(5)
    for position in range(200):
        logits = torch.randn(9, generator=gen)
        q = torch.softmax(torch.randn(9, generator=gen), dim=0)
        draft = sample(q, keyed_generator(SEED, position, "draft"))
        p = target_probs(logits, SamplingParams())
        assert verify_at(p, q, draft, position) == verify_greedy(logits, draft)


def test_filtered_tokens_are_never_emitted():
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -1.5, -2.0])
    p = target_probs(logits, SamplingParams(temperature=0.8, top_k=4))
    emitted = set()
    for position in range(2000):
        draft = sample(Q, keyed_generator(SEED, position, "draft"))
        emitted.add(verify_at(p, Q, draft, position)[1])
    assert emitted == {0, 1, 2, 3}


def test_greedy_rule():
    logits = torch.tensor([0.1, 3.0, -1.0, 3.0])
    assert verify_greedy(logits, 1) == (True, 1)
    assert verify_greedy(logits, 3) == (False, 1)  # tie: the lowest id is the target's token
    assert verify_greedy(logits, 0) == (False, 1)
    assert verify_greedy(7, 7) == (True, 7) and verify_greedy(7, 2) == (False, 7)


def test_invariants_asserted():
    gen = keyed_generator(0, 0, "accept")
    with pytest.raises(AssertionError, match="q\\(x\\) = 0"):
        verify_sampled(P, Q, 3, gen, gen)  # a draft cannot come from a q that gives it 0
    with pytest.raises(AssertionError):
        verify_sampled(P.double(), Q.double(), 0, gen, gen)
    with pytest.raises(AssertionError):
        verify_sampled(P, Q[:5], 0, gen, gen)
    with pytest.raises(AssertionError):
        verify_sampled(P, Q, 9, gen, gen)

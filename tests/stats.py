"""Statistical helpers for tests: total variation distance, chi-square goodness of fit, power.

The chi-square survival function is the regularized upper incomplete gamma function
Q(df/2, x/2), computed in plain Python (series below a+1, continued fraction above), so the
tests need no scipy. For k cells the test detects any shift of total variation `tv` with
noncentrality at least 4 * samples * tv**2 (Cauchy-Schwarz: sum d_i^2/p_i >= (sum |d_i|)^2).
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np

# Level used by the sampling and verification tests. Their draws are keyed, hence
# deterministic, so a low level keeps a correct implementation from failing by chance.
TEST_LEVEL = 1e-3


def _as_arrays(counts, probs) -> tuple[np.ndarray, np.ndarray]:
    counts = np.asarray(counts, dtype=np.float64).ravel()
    probs = np.asarray(probs, dtype=np.float64).ravel()
    assert counts.shape == probs.shape, (counts.shape, probs.shape)
    assert counts.sum() > 0 and probs.min() >= 0 and abs(probs.sum() - 1) < 1e-6, "bad counts or probabilities"
    return counts, probs


def tv_distance(counts: Sequence[float], probs: Sequence[float]) -> float:
    """Total variation distance between the empirical distribution of `counts` and `probs`."""
    counts, probs = _as_arrays(counts, probs)
    return 0.5 * float(np.abs(counts / counts.sum() - probs).sum())


def regularized_gamma_q(a: float, x: float) -> float:
    """Q(a, x) = Gamma(a, x) / Gamma(a) (Numerical Recipes 6.2)."""
    assert a > 0 and x >= 0
    if x == 0:
        return 1.0
    log_prefactor = -x + a * math.log(x) - math.lgamma(a)
    if x < a + 1:  # series for P(a, x) converges fast here
        term = total = 1.0 / a
        k = a
        while abs(term) > abs(total) * 1e-16:
            k += 1
            term *= x / k
            total += term
        return max(0.0, 1.0 - total * math.exp(log_prefactor))
    # continued fraction for Q(a, x) (modified Lentz)
    tiny = 1e-300
    b = x + 1 - a
    c, d = 1 / tiny, 1 / b
    h = d
    for i in range(1, 10_000):
        an = -i * (i - a)
        b += 2
        d = an * d + b
        d = tiny if abs(d) < tiny else d
        c = b + an / c
        c = tiny if abs(c) < tiny else c
        d = 1 / d
        step = d * c
        h *= step
        if abs(step - 1) < 1e-16:
            break
    return math.exp(log_prefactor) * h


def chi2_sf(x: float, df: int) -> float:
    """P(X >= x) for X ~ chi-square with df degrees of freedom."""
    assert df >= 1
    return regularized_gamma_q(df / 2, max(x, 0.0) / 2)


def _merge_small(observed: np.ndarray, expected: np.ndarray, min_expected: float):
    """Pool every cell with expected count < min_expected into one; fold that into the smallest
    remaining cell if it is still too small."""
    small = expected < min_expected
    obs, exp = list(observed[~small]), list(expected[~small])
    if small.any():
        pooled_obs, pooled_exp = float(observed[small].sum()), float(expected[small].sum())
        if pooled_exp >= min_expected or not exp:
            obs.append(pooled_obs)
            exp.append(pooled_exp)
        else:
            i = int(np.argmin(exp))
            obs[i] += pooled_obs
            exp[i] += pooled_exp
    return np.array(obs), np.array(exp)


def chi_square_pvalue(counts: Sequence[float], probs: Sequence[float], min_expected: float = 5.0) -> float:
    """Goodness-of-fit p-value of `counts` against `probs`; 0 if an impossible cell was hit."""
    counts, probs = _as_arrays(counts, probs)
    if (counts[probs == 0] > 0).any():
        return 0.0
    observed, expected = _merge_small(counts[probs > 0], counts.sum() * probs[probs > 0], min_expected)
    if len(observed) < 2:  # one cell holds all the mass: nothing to test
        return 1.0
    statistic = float(((observed - expected) ** 2 / expected).sum())
    return chi2_sf(statistic, len(observed) - 1)


def rejection_rate(true_probs: Sequence[float], sampled_probs: Sequence[float], samples: int,
                   trials: int, level: float = 0.05, seed: int = 0) -> float:
    """Fraction of `trials` in which `samples` draws from sampled_probs fail the chi-square test
    against true_probs at `level`: the power when they differ, the false-alarm rate when equal."""
    rng = np.random.default_rng(seed)
    sampled = np.asarray(sampled_probs, dtype=np.float64)
    rejected = sum(chi_square_pvalue(rng.multinomial(samples, sampled / sampled.sum()), true_probs) < level
                   for _ in range(trials))
    return rejected / trials


def worst_case_shift(probs: Sequence[float], tv: float) -> np.ndarray:
    """A distribution at total variation `tv` from probs that the chi-square test finds hardest:
    mass moved in proportion to p between two halves of (nearly) equal mass, which attains the
    minimum noncentrality 4 * samples * tv**2."""
    probs = np.asarray(probs, dtype=np.float64)
    order = np.argsort(-probs)
    half = np.zeros(len(probs), dtype=bool)
    mass = 0.0
    for i in order:  # greedy split into two halves of about equal mass
        if mass < 0.5 * probs.sum() - 1e-12 and mass + probs[i] <= 0.5 * probs.sum() + 1e-12:
            half[i] = True
            mass += probs[i]
    up, down = probs[half].sum(), probs[~half].sum()
    assert tv <= min(up, down), "shift too large for this distribution"
    shifted = probs.copy()
    shifted[half] += tv * probs[half] / up
    shifted[~half] -= tv * probs[~half] / down
    return shifted

"""Lossless sampling of the eagle baseline, measured: at T>0 the tokens a draft-then-verify round
commits (accepted drafts, then a residual draw or the bonus token) are distributed exactly as plain
autoregressive sampling from the target, whatever the draft distribution.

As in test_sampling_distribution.py: a target with a 6-token vocabulary, the exact joint
distribution of the first four generated tokens computed from the full model (1 + 6 + 36 + 216
forwards) with the run's sampling parameters, top-k 2 so that 16 cells carry mass, requests keyed
by seed on one executor, total variation and chi-square at TEST_LEVEL (tests/stats.py). With k = 2
a request is the prefill token, one chain of two drafts and its bonus or correction, then (after a
rejection) another round: chains, residuals, bonus tokens and re-drafts are all exercised.

Drafts: the untrained head's own q, and draft policies that replace q by a function of the draft's
context (committed tokens and the chain's earlier drafts): "poor" (most mass on (last + 1) mod 6)
and "good" (0.85 p + 0.15 uniform). The default run keeps the poor draft (3,000
requests) and the broken verifiers; the good draft and the head's own q are slow. The check must
fail for broken verifiers, run on the driver:
- accept-always: every draft committed (blatant);
- residual-from-p: on rejection the token is drawn from p instead of norm(max(p - q, 0)) (subtle).
"""
from __future__ import annotations

import dataclasses
import functools
import time
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch
from helpers import full_model, in_shares, seed_pool, tiny_cfg, tiny_engine_config  # noqa: F401
from stats import TEST_LEVEL, chi_square_pvalue, rejection_rate, tv_distance, worst_case_shift

from spd_engine.engine.model.greedy import prefill
from spd_engine.engine.protocol.sampling import SamplingParams, keyed_generator, sample, target_probs, uniform
from spd_engine.engine.runtime.reference import ReferenceExecutor

V, NEW, K = 6, 4, 2
PROMPT = (1, 4, 3, 5)
PARAMS = SamplingParams(temperature=1.0, top_k=2)
SMALL = 3000


def engine_config():
    cfg = tiny_cfg("llama", vocab_size=V, num_layers=2)
    # row-major weights: the packed CPU default is slower at these shapes (test_sampling_distribution.py Setup)
    return tiny_engine_config("llama", 1, mode="eagle", cfg=cfg, eagle_k=K, capacity=16, prefill_chunk=16, threads=1,
                              weight_layout="row")


@torch.no_grad()
def conditionals() -> dict[tuple[int, ...], torch.Tensor]:
    """p(next | prompt + prefix) [V] for every generated prefix shorter than NEW."""
    ecfg = engine_config()
    model = full_model(ecfg)
    out = {}
    for length in range(NEW):
        for prefix in np.ndindex(*(V,) * length):
            ids = list(PROMPT) + list(prefix)
            h = prefill(model, model.new_cache(1, len(ids)), ids, ecfg.runtime.prefill_chunk)
            out[tuple(int(t) for t in prefix)] = target_probs(model.logits(h), PARAMS)
    return out


def exact_joint(cond) -> np.ndarray:
    joint = np.zeros(V ** NEW)
    for cell in range(V ** NEW):
        tokens = np.unravel_index(cell, (V,) * NEW)
        joint[cell] = np.prod([float(cond[tuple(int(x) for x in tokens[:i])][t]) for i, t in enumerate(tokens)])
    return joint / joint.sum()


@dataclass
class ContextPolicy:
    """q for the draft at `pos` from its context: committed tokens, then this chain's earlier drafts
    (read by spying on the driver's `_draft`)."""

    kind: str
    cond: dict
    driver: object
    chain: dict[int, int] = field(default_factory=dict)  # position -> draft made there

    def __post_init__(self) -> None:
        draft = self.driver._draft

        def spy(h, pos):
            token = draft(h, pos)
            self.chain[pos] = token
            return token

        self.driver._draft = spy

    def context(self, pos: int) -> tuple[int, ...]:
        ctx = self.driver.req.context
        return tuple(ctx[x] if x < len(ctx) else self.chain[x] for x in range(len(PROMPT), pos))

    def __call__(self, pos: int, q: torch.Tensor) -> torch.Tensor:
        context, flat = self.context(pos), torch.full((V,), 1.0 / V)
        if self.kind == "poor":
            out = 0.3 * flat
            out[(context[-1] + 1) % V] += 0.7
        else:
            out = 0.85 * self.cond[context] + 0.15 * flat if context in self.cond else flat
        return out.to(q)


def accept_always(driver) -> None:
    driver._verify = lambda logits, pos, proposed, target: (True, proposed)


def residual_from_p(driver) -> None:
    def broken(logits, pos, proposed, target):
        sp = driver.req.sampling
        p, q = target_probs(logits, sp), driver.req.q_store.pop(pos)
        if uniform(keyed_generator(sp.seed, pos, "accept")) * float(q[proposed]) < float(p[proposed]):
            return True, proposed
        return False, sample(p, keyed_generator(sp.seed, pos, "residual"))

    driver._verify = broken


BROKEN = {"accept-always": accept_always, "residual-from-p": residual_from_p}


def draw(kind: str, seeds, broken: str | None = None) -> tuple[np.ndarray, list, int, int, float]:
    """(counts [V**NEW], outputs, verified, accepted, seconds) of one request per seed."""
    torch.set_num_threads(1)
    cond = conditionals() if kind == "good" else {}
    counts, outputs, verified, accepted = np.zeros(V ** NEW, dtype=np.int64), [], 0, 0
    t0 = time.perf_counter()
    with ReferenceExecutor(engine_config()) as ex:
        policy = None if kind == "head" else ContextPolicy(kind, cond, ex.driver)
        if broken is not None:
            BROKEN[broken](ex.driver)
        for seed in seeds:
            res = ex.generate(list(PROMPT), NEW, (), draft_policy=policy, sampling=dataclasses.replace(PARAMS, seed=seed))
            assert len(res.tokens) == NEW
            counts[np.ravel_multi_index(res.tokens, (V,) * NEW)] += 1
            outputs.append(tuple(res.tokens))
            verified, accepted = verified + res.verified, accepted + res.accepted
    return counts, outputs, verified, accepted, time.perf_counter() - t0


def draw_parallel(pool, kind: str, seeds, broken: str | None = None) -> tuple[np.ndarray, list, int, int, float]:
    """`draw` over the pool's processes, a contiguous share of seeds each (seconds: the longest share's)."""
    parts = in_shares(pool, functools.partial(draw, kind, broken=broken), seeds)
    return (sum(p[0] for p in parts), [o for p in parts for o in p[1]], sum(p[2] for p in parts),
            sum(p[3] for p in parts), max(p[4] for p in parts))


def tv_bound(joint: np.ndarray, samples: int, trials: int = 2000) -> float:
    rng = np.random.default_rng(0)
    return float(np.quantile([tv_distance(rng.multinomial(samples, joint), joint) for _ in range(trials)],
                             1 - TEST_LEVEL))


def passes(counts: np.ndarray, joint: np.ndarray, label: str) -> bool:
    tv, bound, pvalue = tv_distance(counts, joint), tv_bound(joint, int(counts.sum())), chi_square_pvalue(counts, joint)
    print(f"\n{label}: N={int(counts.sum())} TV={tv:.4f} (bound {bound:.4f}) p={pvalue:.3g}")
    return pvalue > TEST_LEVEL and tv < bound


@pytest.fixture(scope="module")
def joint() -> np.ndarray:
    j = exact_joint(conditionals())
    assert (j > 0).sum() == 2 ** NEW  # top-k 2: two tokens per step
    return j


@pytest.fixture(scope="module")
def poor_draws(seed_pool):
    return draw_parallel(seed_pool, "poor", range(SMALL))


def test_eagle_samples_the_target_distribution_poor_draft(poor_draws, joint, one_thread):
    """3,000 requests with the poor draft (many rejections: residual draws, re-drafts) pass, and
    this size detects a 0.06 total-variation shift with probability >= 0.9."""
    counts, _, verified, accepted, secs = poor_draws
    print(f"poor: alpha {accepted / verified:.3f}, {1e3 * secs / SMALL:.1f} ms/request")
    assert passes(counts, joint, "poor correct")
    assert accepted < 0.6 * verified
    assert rejection_rate(joint, worst_case_shift(joint, 0.06), SMALL, 1000, level=TEST_LEVEL) >= 0.9


@pytest.mark.parametrize("broken,seeds", [("accept-always", 200), ("residual-from-p", 1000)])
def test_broken_verifiers_fail(broken, seeds, poor_draws, joint, seed_pool, one_thread):
    """The same check fails an accept-everything verifier on 200 seeds and a verifier that draws the
    correction from p instead of the residual on 1,000 (measured: it already fails on 500)."""
    counts, outputs, *_ = draw_parallel(seed_pool, "poor", range(seeds), broken)
    assert outputs != poor_draws[1][:seeds]  # the override really changes outputs
    assert not passes(counts, joint, f"poor {broken}")


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["good", "head"])
def test_eagle_samples_the_target_distribution(kind, joint, seed_pool, one_thread):
    """A good draft (whole chains accepted: bonus tokens) and the untrained head's own q."""
    counts, _, verified, accepted, secs = draw_parallel(seed_pool, kind, range(SMALL))
    print(f"{kind}: alpha {accepted / verified:.3f}, {1e3 * secs / SMALL:.1f} ms/request")
    assert passes(counts, joint, f"{kind} correct")
    if kind == "good":
        assert accepted > 0.8 * verified

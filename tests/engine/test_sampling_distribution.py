"""Lossless sampling, measured: at T>0 the tokens SPD commits are distributed exactly as plain
autoregressive sampling from the target (docs/design.md 3.6), whatever the draft distribution.

A target with a 6-token vocabulary makes the joint distribution of the first three generated
tokens (6^3 = 216 cells) exactly computable: 1 + 6 + 36 forwards of the full model, each turned
into p by `target_probs` with the run's sampling parameters. SPD samples come from the reference
executor (the driver and stage workers of a distributed run, in lockstep in one thread: the
threaded ranks give the same runs, tests/engine/test_lockstep.py), one request per
seed on one executor: requests are independent given their seed, because every draw is keyed by
(seed, position, purpose). The correct runs drafted by the PDM alone go through a batch of SEED_BATCH
slots: the steps are batch-invariant, so every request draws its lone tokens (checked on a prefix).
They are compared with the exact distribution by total variation and a
chi-square goodness-of-fit test at level TEST_LEVEL (tests/stats.py).

Draft distributions are plugged in through the driver's draft policy, which at T>0 returns the
distribution q the draft is sampled from:
- poor: most of q's mass on (last in-flight token + 1) mod 6, far from p: many rejections;
- good: 0.85 p(. | in-flight context) + 0.15 uniform: few rejections.
Both depend on the in-flight context, so a position re-drafted after a flush gets a different q.
The context is read by spying on the tokens the driver sends into stage 0.

The test must fail for broken verifiers, so it is also run with two on the driver instance:
- accept-always: `_verify` commits every draft (blatant);
- stale q: `_record_q` keeps the first q recorded for a position (setdefault), so a draft made
  again after a flush is verified against the q of the dropped draft (subtle).

Power: the chi-square test detects every total-variation shift of size `tv` with noncentrality
at least 4 N tv^2, but its critical value grows with the number of cells, so with near-uniform p
over 216 cells no test on 20,000 draws sees every 0.02 shift. The full-size setups therefore
sample with filters that leave 2 tokens per step (8 cells with mass): top-k 2, and top-k 3 then
top-p 0.7 (top-p drops the third token at every reachable step). There `worst_case_shift` at 0.02
is detected with probability >= 0.9; the unfiltered setup reports the shift it detects with that
power.

The full-size runs (>= 20,000 requests each, several minutes on two cores) are marked slow; the
default run keeps a 2,500-request check (3,000 with W = 2), which still fails the accept-always verifier.
"""
from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch
from helpers import full_model, in_shares, seed_pool, tiny_cfg, tiny_engine_config  # noqa: F401
from stats import TEST_LEVEL, chi_square_pvalue, rejection_rate, tv_distance, worst_case_shift

from spd_engine.engine.model.greedy import prefill
from spd_engine.engine.protocol.drafting import SUFFIX, SUFFIX_RUN
from spd_engine.engine.protocol.messages import META_FIELDS, Kind
from spd_engine.engine.protocol.metrics import GenerationResult
from spd_engine.engine.protocol.sampling import SamplingParams, keyed_generator, sample, target_probs, uniform
from spd_engine.engine.runtime.batch_driver import BatchRequest
from spd_engine.engine.runtime.reference import ReferenceExecutor
from spd_engine.engine.runtime.run_config import RunConfig

V = 6
NEW = 3  # the first three generated tokens: the prefill token and two verified drafts
PROMPT = (1, 4, 3, 5)
CELLS = V ** NEW
SHIFT = 0.02  # total variation the full-size test must detect with probability >= 0.9
POWER = 0.9


@dataclass(frozen=True)
class Setup:
    """One sampling experiment: pipeline depth, sampling parameters (seed set per request), draft."""

    name: str
    n: int
    params: SamplingParams
    draft: str  # "poor" | "good" (draft policies) | "pdm" (the untrained PDM's own q, no policy)
    suffix: bool = False  # suffix drafts on (min match 1): point-mass drafts beside the PDM's
    branches: int = 1  # branch width W: several candidates at a branch point (recursive rejection sampling)
    run: int = 1  # --suffix-run: a suffix draft may carry the tokens after it (docs/design.md 3.13)
    prompt: tuple[int, ...] = PROMPT

    def engine_config(self) -> RunConfig:
        # A random:<preset> source builds its weights from the config's shape (engine/runtime/build.py),
        # so a 6-token vocabulary needs no preset of its own. One layer per stage keeps it cheap, and
        # so do row-major weights: at these 64-wide shapes oneDNN's packed layout (the CPU default)
        # takes about 4x longer a matmul. The check is of the acceptance rule, not of a layout's
        # rounding, and the exact distribution (`conditionals`) is computed with the same weights.
        cfg = tiny_cfg("llama", vocab_size=V, num_layers=self.n)
        extra = dict(suffix_drafts=True, suffix_min_match=1) if self.suffix else {}
        extra.update(branches=self.branches, branch_when="always") if self.branches > 1 else None
        extra.update(suffix_run=self.run) if self.run > 1 else None
        return tiny_engine_config("llama", self.n, cfg=cfg, capacity=16, prefill_chunk=16, threads=1,
                                  weight_layout="row", **extra)


POOR_TOPK = Setup("poor-topk2", 2, SamplingParams(temperature=1.0, top_k=2), "poor")
GOOD_TOPP = Setup("good-topk3-topp", 3, SamplingParams(temperature=1.0, top_k=3, top_p=0.7), "good")
POOR_FULL = Setup("poor-unfiltered", 2, SamplingParams(temperature=0.5), "poor")
SUFFIX_TOPK = Setup("suffix-topk2", 2, SamplingParams(temperature=1.0, top_k=2), "pdm", suffix=True)
# W = 2 at n = 3: the first draft is a branch point (a sampled PDM draft, then a point mass: the
# suffix draft or the PDM's best other token), the second a chain's own draft. Top-k 3: with top-k
# 2 the second candidate never commits here (27 cells with mass instead of 8: less power)
BRANCH_TOPK = Setup("branch-w2-topk3", 3, SamplingParams(temperature=1.0, top_k=3), "pdm", suffix=True, branches=2)
# suffix runs (docs/design.md 3.13): where the prompt holds a match for the first token, the draft
# behind it carries the next one, verified on its own exit row when the entry leaves (the third token)
RUN_TOPK = Setup("suffix-run-topk2", 2, SamplingParams(temperature=1.0, top_k=2), "pdm", suffix=True, run=3,
                 prompt=(0, 5, 1, 5, 0, 4, 3))
# two requests live in one pipeline (docs/design.md 3.12), the untrained PDM's own q, with RUN_TOPK's
# suffix runs (3.13), which travel in the batch as a row per token
BATCH_TOPK = Setup("batch-2-run-topk2", 2, SamplingParams(temperature=1.0, top_k=2), "pdm", suffix=True, run=3,
                   prompt=RUN_TOPK.prompt)


# ---- the exact distribution ----

Conditionals = dict[tuple[int, ...], torch.Tensor]  # generated prefix -> p [V] (fp32) of the next token


@torch.no_grad()
def conditionals(setup: Setup) -> Conditionals:
    """p(next | prompt + prefix) for every generated prefix of length < NEW, from the full target."""
    ecfg = setup.engine_config()
    model = full_model(ecfg)
    out: Conditionals = {}
    for length in range(NEW):
        for prefix in np.ndindex(*(V,) * length):
            ids = list(setup.prompt) + list(prefix)
            h = prefill(model, model.new_cache(1, len(ids)), ids, ecfg.runtime.prefill_chunk)  # [H]
            out[tuple(int(t) for t in prefix)] = target_probs(model.logits(h), setup.params)
    return out


def exact_joint(cond: Conditionals) -> np.ndarray:
    """P(first NEW tokens = cell) for all V**NEW cells (index a*V*V + b*V + c), float64."""
    joint = np.zeros(CELLS)
    for cell in range(CELLS):
        tokens = np.unravel_index(cell, (V,) * NEW)
        prob = 1.0
        for i, t in enumerate(tokens):
            prob *= float(cond[tuple(int(x) for x in tokens[:i])][t])
        joint[cell] = prob
    return joint / joint.sum()  # each p sums to 1 up to fp32 rounding


# ---- draft distributions ----

_POSITION, _TOKEN, _CHAIN = (META_FIELDS.index(f) for f in ("position", "token", "chain"))

class ContextSpy:
    """Records the token the driver sends into stage 0 at each position (last one wins: a flush
    re-sends the positions after a correction), i.e. the in-flight context of the next draft."""

    def __init__(self, driver, prompt_len: int) -> None:
        self.P, self.tokens = prompt_len, {}
        send = driver.stage0.send

        def spy(hdr, payloads=(), **kw):
            if hdr.kind == Kind.BATCH:  # a request alone: its entry's rows (a branch point's chain 0)
                for row in payloads[0].tolist():
                    if row[_CHAIN] == 0:
                        self.tokens[row[_POSITION]] = row[_TOKEN]
            return send(hdr, payloads, **kw)

        driver.stage0.send = spy

    def before(self, pos: int) -> tuple[int, ...]:
        """The generated tokens in front of position `pos`."""
        return tuple(self.tokens[p] for p in range(self.P, pos))


@dataclass
class DraftPolicy:
    """q for the draft at `pos` from its in-flight context; counts re-drafts with a changed q."""

    kind: str
    cond: Conditionals
    spy: ContextSpy
    seen: dict[int, torch.Tensor] = field(default_factory=dict)  # this request: pos -> first q
    redrafts: int = 0
    changed: int = 0

    def reset(self) -> None:
        self.seen.clear()
        self.spy.tokens.clear()

    def q(self, context: tuple[int, ...]) -> torch.Tensor:
        uniform = torch.full((V,), 1.0 / V)
        if self.kind == "poor":
            q = 0.3 * uniform
            q[(context[-1] + 1) % V] += 0.7
            return q
        if context in self.cond:  # good: close to p
            return 0.85 * self.cond[context] + 0.15 * uniform
        return uniform  # drafts past the third token are never verified

    def __call__(self, pos: int, pdm_q: torch.Tensor) -> torch.Tensor:
        q = self.q(self.spy.before(pos)).to(pdm_q)
        if pos in self.seen:
            self.redrafts += 1
            self.changed += int(not torch.equal(self.seen[pos], q))
        else:
            self.seen[pos] = q
        return q


# ---- broken verifiers ----

def accept_always(driver) -> None:
    driver.verifier.verify = lambda pos, proposed, q, sp, row=0, reply=-1: (True, proposed)


def _after_draft(driver, change: Callable) -> None:
    """Run `change(record before, record after, chain)` on the draft record of every draft."""
    draft = driver.drafter.draft

    def broken(req, h_last, plan, draft_id=None, chain=0):
        before = req.drafts.at.get(plan.draft_pos)
        before = None if before is None else (list(before.sources), list(before.qs))
        token = draft(req, h_last, plan, draft_id, chain)
        change(before, req.drafts.at[plan.draft_pos], chain)
        return token

    driver.drafter.draft = broken


def stale_q(driver) -> None:
    """A re-draft after a flush verified against the q of the position's first draft."""
    def keep_first(before, rec, chain):
        if before is not None and chain < len(before[1]) and before[1][chain] is not None:
            rec.qs[chain] = before[1][chain]

    _after_draft(driver, keep_first)


def suffix_as_uniform(driver) -> None:
    """A multi-source bug: a suffix draft verified as if drawn from the uniform distribution
    instead of its point mass."""
    def uniform_q(_before, rec, chain):
        if rec.sources[chain] == SUFFIX and rec.qs[chain] is not None:
            rec.qs[chain] = torch.full_like(rec.qs[chain], 1.0 / rec.qs[chain].numel())

    _after_draft(driver, uniform_q)


def forget_residual(driver) -> None:
    """A multi-draft bug: each candidate of a branch point is tested against p itself instead of
    the residual the candidates before it left (and the last residual is p's)."""
    def broken(pos, tokens, cands, sp, row, reply=-1):
        p = target_probs(driver.head.logits(driver.verifier.exit_buf[row]), sp)
        accept = keyed_generator(sp.seed, pos, "accept")
        for i, c in enumerate(cands):
            q = c.q_of(p)
            if uniform(accept) * float(q[c.token]) < float(p[c.token]):
                return i, c.token
        return None, sample(p, keyed_generator(sp.seed, pos, "residual"))

    driver.verifier.verify_branch = broken


def run_unverified(driver) -> None:
    """A suffix-run bug: the run's tokens committed as if verified (counted, never tested against p)."""
    def broken(req, ex, reply):
        for i in range(len(ex.run)):
            rec = req.drafts.take(ex.pos + 1 + i)
            req.count_verified(rec.sources[0], True)
        return None, -1

    driver.lane._verify_run = broken


BROKEN: dict[str, Callable] = {"accept-always": accept_always, "stale-q": stale_q, "suffix-uniform": suffix_as_uniform,
                               "forget-residual": forget_residual,
                               "run-unverified": run_unverified}


# ---- sampling runs ----

@dataclass
class Draws:
    counts: np.ndarray  # [CELLS]
    outputs: list[tuple[int, ...]]  # per seed, in seed order
    verified: int
    accepted: int
    redrafts: int
    changed: int
    seconds: float
    suffix_verified: int = 0  # verified drafts that came from the suffix source
    branch_points: int = 0  # verified branch points (W > 1)
    branch_saves: int = 0  # of them, committed from a candidate after the first
    run_verified: int = 0  # verified tokens of suffix runs

    @staticmethod
    def merge(parts: Sequence["Draws"]) -> "Draws":
        return Draws(sum(p.counts for p in parts), [o for p in parts for o in p.outputs],
                     *(sum(getattr(p, f) for p in parts) for f in ("verified", "accepted", "redrafts", "changed")),
                     max(p.seconds for p in parts), *(sum(getattr(p, f) for p in parts)
                                                      for f in ("suffix_verified", "branch_points", "branch_saves",
                                                                "run_verified")))


def _results(ex: ReferenceExecutor, setup: Setup, seeds: Sequence[int], policy: DraftPolicy | None,
             batch: int) -> Iterator[GenerationResult]:
    """Each seed's result: one request at a time, or all of them through one batch of `batch` slots."""
    params = [dataclasses.replace(setup.params, seed=seed) for seed in seeds]
    if batch > 1:
        yield from ex.generate_batch([BatchRequest(list(setup.prompt), NEW, sampling=p) for p in params], batch).results
        return
    for p in params:
        if policy is not None:
            policy.reset()
        yield ex.generate(list(setup.prompt), NEW, (), draft_policy=policy, sampling=p)


def draw(setup: Setup, seeds: Sequence[int], broken: str | None = None, batch: int = 1) -> Draws:
    """One SPD request per seed on one reference executor; counts of the first NEW tokens. `batch` > 1:
    the requests share stage steps, `batch` at a time (a slot taking the next request as one ends);
    with the PDM's own drafts only (a draft policy and a broken verifier act on the driver's own
    request parts, which a batch gives its first slot alone). Steps are batch-invariant, so each
    request draws what it draws alone (the tests check it on a prefix of the seeds)."""
    assert batch == 1 or (setup.draft == "pdm" and broken is None)
    torch.set_num_threads(1)
    cond = conditionals(setup) if setup.draft == "good" else {}
    counts = np.zeros(CELLS, dtype=np.int64)
    outputs, verified, accepted, from_suffix, points, saves, runs = [], 0, 0, 0, 0, 0, 0
    t0 = time.perf_counter()
    with ReferenceExecutor(setup.engine_config()) as ex:
        policy = None if setup.draft == "pdm" else DraftPolicy(setup.draft, cond, ContextSpy(ex.driver, len(setup.prompt)))
        if broken is not None:
            BROKEN[broken](ex.driver)
        for res in _results(ex, setup, seeds, policy, batch):
            assert len(res.tokens) == NEW
            counts[np.ravel_multi_index(res.tokens, (V,) * NEW)] += 1
            outputs.append(tuple(res.tokens))
            verified, accepted = verified + res.verified, accepted + res.accepted
            from_suffix += res.by_source.get(SUFFIX, [0, 0, 0])[1]
            runs += res.by_source.get(SUFFIX_RUN, [0, 0, 0])[1]
            points, saves = points + res.branch_points, saves + res.branch_saves
    redrafts, changed = (policy.redrafts, policy.changed) if policy is not None else (0, 0)
    return Draws(counts, outputs, verified, accepted, redrafts, changed, time.perf_counter() - t0, from_suffix,
                 points, saves, runs)


def draw_parallel(pool, setup: Setup, seeds: Sequence[int], broken: str | None = None, batch: int = 1) -> Draws:
    """`draw` over the pool's processes, each with its own executor and a contiguous share of seeds."""
    return Draws.merge(in_shares(pool, functools.partial(draw, setup, broken=broken, batch=batch), seeds))


# ---- the statistics ----

@dataclass
class Verdict:
    tv: float
    tv_bound: float  # 1 - TEST_LEVEL quantile of the TV of exact multinomial samples of the same size
    pvalue: float

    @property
    def passes(self) -> bool:
        return self.pvalue > TEST_LEVEL and self.tv < self.tv_bound


def tv_quantile(joint: np.ndarray, samples: int, trials: int = 2000, seed: int = 0) -> float:
    rng = np.random.default_rng(seed)
    tvs = [tv_distance(rng.multinomial(samples, joint), joint) for _ in range(trials)]  # joint sums to 1
    return float(np.quantile(tvs, 1 - TEST_LEVEL))


def judge(draws: Draws, joint: np.ndarray) -> Verdict:
    N = int(draws.counts.sum())
    return Verdict(tv_distance(draws.counts, joint), tv_quantile(joint, N), chi_square_pvalue(draws.counts, joint))


def power(joint: np.ndarray, samples: int, shift: float = SHIFT, trials: int = 1000) -> float:
    """P(the chi-square test at TEST_LEVEL rejects `samples` draws from the hardest `shift`-TV change)."""
    return rejection_rate(joint, worst_case_shift(joint, shift), samples, trials, level=TEST_LEVEL)


def report(label: str, draws: Draws, verdict: Verdict) -> None:
    N = len(draws.outputs)
    print(f"\n{label}: N={N} alpha={draws.accepted / max(1, draws.verified):.3f} redrafts={draws.redrafts} "
          f"(q changed {draws.changed}) TV={verdict.tv:.4f} (bound {verdict.tv_bound:.4f}) "
          f"p={verdict.pvalue:.3g} {draws.seconds:.0f}s ({1e3 * draws.seconds / N:.1f} ms/request)")


# ---- default run ----

SMALL = 2500
SMALL_SHIFT = 0.06  # the small run detects this total-variation shift with probability >= 0.9 (0.95 over 8 cells)
STALE_PREFIX = 500
BLATANT_PREFIX = 200
BRANCH_SMALL = 3000  # 27 cells: at 2,500 requests the power against SMALL_SHIFT would be 0.69
# the PDM's own drafts (no draft policy) are drawn SEED_BATCH requests at a time, about half the time of one
# by one; the first ALONE seeds are drawn alone too, and must give the same tokens
SEED_BATCH = 8
ALONE = 100


def test_exact_distribution_is_a_distribution_and_filters_apply():
    cond = conditionals(POOR_TOPK)
    assert all(float(p.sum()) == pytest.approx(1.0, abs=1e-6) and int((p > 0).sum()) == 2 for p in cond.values())
    assert (exact_joint(cond) > 0).sum() == 2 ** NEW  # top-k 2: two tokens per step
    assert (exact_joint(conditionals(POOR_FULL)) > 0).sum() == CELLS
    no_top_p = dataclasses.replace(GOOD_TOPP, params=dataclasses.replace(GOOD_TOPP.params, top_p=1.0))
    assert (exact_joint(conditionals(no_top_p)) > 0).sum() == 3 ** NEW  # top-k 3 alone
    assert (exact_joint(conditionals(GOOD_TOPP)) > 0).sum() == 2 ** NEW  # top-p cuts every reachable step


def test_spd_samples_the_target_distribution_small(seed_pool, one_thread):
    """2,500 requests with the poor draft pass. The same check fails the accept-always verifier on
    the first 200 seeds (a count in a cell of probability 0, so every superset of those seeds fails
    too) and the stale-q verifier on the first 500 seeds."""
    joint = exact_joint(conditionals(POOR_TOPK))
    good = draw_parallel(seed_pool, POOR_TOPK, range(SMALL))
    verdict = judge(good, joint)
    report(f"{POOR_TOPK.name} correct", good, verdict)
    assert verdict.passes, verdict
    assert good.accepted < 0.7 * good.verified  # a poor draft: many rejections ...
    assert good.changed > 0.2 * SMALL  # ... and positions re-drafted after a flush with another q
    detect = power(joint, SMALL, SMALL_SHIFT)
    print(f"power against a {SMALL_SHIFT} TV shift at N={SMALL}: {detect:.3f}")
    assert detect >= POWER

    blatant = draw(POOR_TOPK, range(BLATANT_PREFIX), broken="accept-always")
    report(f"{POOR_TOPK.name} accept-always", blatant, judge(blatant, joint))
    assert chi_square_pvalue(blatant.counts, joint) == 0.0  # a cell of probability 0 was hit

    stale = draw_parallel(seed_pool, POOR_TOPK, range(STALE_PREFIX), broken="stale-q")
    verdict = judge(stale, joint)
    report(f"{POOR_TOPK.name} stale-q", stale, verdict)
    assert stale.outputs != good.outputs[:STALE_PREFIX]  # the override really changes outputs
    assert verdict.pvalue < TEST_LEVEL and not verdict.passes


def test_suffix_drafts_sample_the_target_distribution_small(seed_pool, one_thread):
    """Point-mass suffix drafts beside the PDM's sampled drafts (min match 1, so most requests have
    one): 2,500 requests pass; verifying a suffix draft as if it were drawn from a uniform q (a
    multi-source bug) fails on the first 500 seeds."""
    joint = exact_joint(conditionals(SUFFIX_TOPK))
    good = draw_parallel(seed_pool, SUFFIX_TOPK, range(SMALL), batch=SEED_BATCH)
    assert good.outputs[:ALONE] == draw(SUFFIX_TOPK, range(ALONE)).outputs  # each request draws what it draws alone
    verdict = judge(good, joint)
    report(f"{SUFFIX_TOPK.name} correct", good, verdict)
    assert verdict.passes, verdict
    assert good.suffix_verified > 0.3 * good.verified  # the suffix source really drafts
    bad = draw_parallel(seed_pool, SUFFIX_TOPK, range(STALE_PREFIX), broken="suffix-uniform")
    verdict = judge(bad, joint)
    report(f"{SUFFIX_TOPK.name} suffix-uniform", bad, verdict)
    assert bad.outputs != good.outputs[:STALE_PREFIX]
    assert verdict.pvalue < TEST_LEVEL and not verdict.passes


def test_suffix_runs_sample_the_target_distribution_small(seed_pool, one_thread):
    """Suffix runs (docs/design.md 3.13): the second draft travels in the first one's entry and is
    verified on its own exit row. 2,500 requests pass; committing a run's tokens unverified fails on
    the first 500 seeds."""
    joint = exact_joint(conditionals(RUN_TOPK))
    good = draw_parallel(seed_pool, RUN_TOPK, range(SMALL), batch=SEED_BATCH)
    assert good.outputs[:ALONE] == draw(RUN_TOPK, range(ALONE)).outputs  # each request draws what it draws alone
    verdict = judge(good, joint)
    report(f"{RUN_TOPK.name} correct", good, verdict)
    assert verdict.passes, verdict
    assert good.run_verified > 0.15 * SMALL  # runs really travel (in about a quarter of the requests)
    bad = draw_parallel(seed_pool, RUN_TOPK, range(STALE_PREFIX), broken="run-unverified")
    verdict = judge(bad, joint)
    report(f"{RUN_TOPK.name} run-unverified", bad, verdict)
    assert bad.outputs != good.outputs[:STALE_PREFIX]
    assert verdict.pvalue < TEST_LEVEL and not verdict.passes


def test_branch_candidates_sample_the_target_distribution_small(seed_pool, one_thread):
    """W = 2: a branch point's candidates verified by recursive rejection sampling, then the
    survivor's chain: 3,000 requests pass (over 27 cells the power against a SMALL_SHIFT change is
    lower than the other small runs': 0.84, asserted >= 0.8); a verifier that tests every
    candidate against p instead of the residual fails on the first 500 seeds (observed p ~ 1e-8)."""
    joint = exact_joint(conditionals(BRANCH_TOPK))
    good = draw_parallel(seed_pool, BRANCH_TOPK, range(BRANCH_SMALL), batch=SEED_BATCH)
    assert good.outputs[:ALONE] == draw(BRANCH_TOPK, range(ALONE)).outputs  # each request draws what it draws alone
    verdict = judge(good, joint)
    report(f"{BRANCH_TOPK.name} correct", good, verdict)
    assert verdict.passes, verdict
    detect = power(joint, BRANCH_SMALL, SMALL_SHIFT)
    print(f"power against a {SMALL_SHIFT} TV shift at N={BRANCH_SMALL}: {detect:.3f}")
    assert detect >= 0.8
    assert good.branch_points >= BRANCH_SMALL and good.branch_saves > 0.02 * BRANCH_SMALL  # later candidates commit
    bad = draw_parallel(seed_pool, BRANCH_TOPK, range(STALE_PREFIX), broken="forget-residual")
    verdict = judge(bad, joint)
    report(f"{BRANCH_TOPK.name} forget-residual", bad, verdict)
    assert bad.outputs != good.outputs[:STALE_PREFIX]
    assert verdict.pvalue < TEST_LEVEL and not verdict.passes


def other_exit(live_cls) -> Callable:
    """A several-requests bug: the second request's verifier reads the first request's exit rows,
    so its drafts are judged against the other request's p."""
    init = live_cls.__init__

    def broken(self, run, index, slot, serial, request):
        init(self, run, index, slot, serial, request)
        if slot == 1 and run.slots[0] is not None:
            self.lane.verifier.exit_buf = run.slots[0].exits

    return broken


def draw_batch(setup: Setup, seeds: Sequence[int], broken: bool = False) -> tuple[Draws, Draws]:
    """Two requests per run (seeds in pairs), both live from tick 1 at B = 2: (the first requests'
    draws, the second requests' draws)."""
    from spd_engine.engine.runtime import batch_driver

    torch.set_num_threads(1)
    counts = [np.zeros(CELLS, dtype=np.int64), np.zeros(CELLS, dtype=np.int64)]
    outputs: list[list[tuple[int, ...]]] = [[], []]
    verified, accepted, runs = [0, 0], [0, 0], [0, 0]
    t0 = time.perf_counter()
    init = batch_driver.LiveRequest.__init__
    if broken:
        batch_driver.LiveRequest.__init__ = other_exit(batch_driver.LiveRequest)
    try:
        with ReferenceExecutor(setup.engine_config()) as ex:
            for a, b in zip(seeds[0::2], seeds[1::2]):
                reqs = [batch_driver.BatchRequest(list(setup.prompt), NEW,
                                                  sampling=dataclasses.replace(setup.params, seed=s)) for s in (a, b)]
                for k, res in enumerate(ex.generate_batch(reqs, 2).results):
                    counts[k][np.ravel_multi_index(res.tokens, (V,) * NEW)] += 1
                    outputs[k].append(tuple(res.tokens))
                    verified[k] += res.verified
                    accepted[k] += res.accepted
                    runs[k] += res.by_source.get(SUFFIX_RUN, [0, 0, 0])[1]
    finally:
        batch_driver.LiveRequest.__init__ = init
    dt = time.perf_counter() - t0
    first, second = (Draws(counts[k], outputs[k], verified[k], accepted[k], 0, 0, dt, run_verified=runs[k])
                     for k in (0, 1))
    return first, second


def draw_batch_parallel(pool, setup: Setup, seeds: Sequence[int], broken: bool = False) -> tuple[Draws, Draws]:
    """`draw_batch` over the pool's processes, each a contiguous share of whole seed pairs: (every
    request's draws, the first requests' outputs then the second requests', the second requests'
    draws)."""
    parts = in_shares(pool, functools.partial(draw_batch, setup, broken=broken), seeds, unit=2)
    first, second = Draws.merge([f for f, _ in parts]), Draws.merge([s for _, s in parts])
    return Draws.merge([first, second]), second


def test_two_live_requests_sample_the_target_distribution_small(seed_pool, one_thread):
    """Two requests share every stage step (B = 2), suffix runs travelling in the batch: 2,500
    requests (1,250 runs) pass, and each request's output is its own solo seeded output; a driver
    whose second request verifies against the first request's exit rows fails on the second
    requests of 500 runs."""
    joint = exact_joint(conditionals(BATCH_TOPK))
    good, _ = draw_batch_parallel(seed_pool, BATCH_TOPK, range(SMALL))
    verdict = judge(good, joint)
    report(f"{BATCH_TOPK.name} correct", good, verdict)
    assert verdict.passes, verdict
    assert good.accepted < 0.8 * good.verified  # rejections, so residual draws happen
    assert good.run_verified > 0.15 * SMALL  # runs really travel inside the batch
    solo = draw(BATCH_TOPK, range(0, 200))
    assert good.outputs[:100] == solo.outputs[0::2][:100] and good.outputs[SMALL // 2:][:100] == solo.outputs[1::2][:100]
    _, bad = draw_batch_parallel(seed_pool, BATCH_TOPK, range(2 * STALE_PREFIX), broken=True)
    verdict = judge(bad, joint)
    report(f"{BATCH_TOPK.name} other-exit (second requests)", bad, verdict)
    assert bad.outputs != good.outputs[SMALL // 2:][:STALE_PREFIX]
    assert verdict.pvalue < TEST_LEVEL and not verdict.passes


# ---- full size (slow) ----

FULL = 24000  # >= 20,000 requests; 24,000 puts the power against a 0.02 shift over 8 cells near 0.95
FULL_UNFILTERED = 20000


@pytest.fixture(scope="module")
def full_runs(seed_pool) -> tuple:
    """Full-size draws shared by the tests of this module (the correct poor-draft run serves two),
    and the pool that draws them."""
    return {}, seed_pool


def full_draws(runs: tuple, setup: Setup, broken: str | None = None) -> Draws:
    cache, pool = runs
    key = (setup.name, broken)
    if key not in cache:
        cache[key] = draw_parallel(pool, setup, range(FULL_UNFILTERED if setup is POOR_FULL else FULL), broken)
    return cache[key]


@pytest.mark.slow
@pytest.mark.parametrize("setup", [POOR_TOPK, GOOD_TOPP], ids=lambda s: s.name)
def test_spd_samples_the_target_distribution(setup, full_runs):
    joint = exact_joint(conditionals(setup))
    draws = full_draws(full_runs, setup)
    verdict = judge(draws, joint)
    detect = power(joint, FULL)
    report(f"{setup.name} correct", draws, verdict)
    print(f"power against a {SHIFT} TV shift at N={FULL}: {detect:.3f}")
    assert verdict.passes, verdict
    assert detect >= POWER
    alpha = draws.accepted / draws.verified
    assert alpha < 0.7 if setup.draft == "poor" else alpha > 0.8
    assert draws.changed > 0.05 * FULL  # re-drafts after a flush, with another q


@pytest.mark.slow
def test_stale_q_verifier_fails(full_runs):
    joint = exact_joint(conditionals(POOR_TOPK))
    good = full_draws(full_runs, POOR_TOPK)
    bad = full_draws(full_runs, POOR_TOPK, "stale-q")
    verdict = judge(bad, joint)
    report(f"{POOR_TOPK.name} stale-q", bad, verdict)
    changed = sum(a != b for a, b in zip(good.outputs, bad.outputs))
    print(f"outputs changed by the stale-q verifier: {changed} of {FULL}")
    assert changed > 0 and verdict.pvalue < TEST_LEVEL and not verdict.passes


@pytest.mark.slow
def test_unfiltered_sampling(full_runs):
    """No top-k / top-p: all 216 cells have mass. Reports the power against a 0.02 shift at this N
    (low: see the module docstring) and checks the shift detected with probability >= 0.9."""
    joint = exact_joint(conditionals(POOR_FULL))
    draws = full_draws(full_runs, POOR_FULL)
    verdict = judge(draws, joint)
    report(f"{POOR_FULL.name} correct", draws, verdict)
    shifts = {s: power(joint, FULL_UNFILTERED, s, trials=300) for s in (SHIFT, 0.03, 0.04)}
    print("power by TV shift: " + ", ".join(f"{s}: {p:.2f}" for s, p in shifts.items()))
    assert verdict.passes, verdict
    assert shifts[0.04] >= POWER

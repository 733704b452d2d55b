"""Branch width W in the tick protocol (engine/protocol/tick.py, docs/design.md 3.11), pure logic: branch
points start where the policy says, chains draft one token each until the branch point is
verified, the survivor's tokens become the representative's, the first entry after a resolution
names the survivor, and the committed tokens are the target's whatever the candidates."""
from __future__ import annotations

import random

import pytest

from spd_engine.engine.protocol.branching import BranchPolicy
from spd_engine.engine.protocol.tick import Draft, TickState, Verdict

pytestmark = pytest.mark.pure  # the fast tier: logic only, no process, no model file


def truth(pos: int) -> int:
    return 10 * pos


def play(n: int, N: int, policy: BranchPolicy, candidates, chain_draft, first_pos: int = 50):
    """Drive a TickState as the driver does until N tokens are committed. candidates(pos, fill)
    -> tokens of a new branch point; chain_draft(pos, chain) -> a chain's (or the only) draft.
    The target's token at every position is truth(pos). Returns (state, plans, committed)."""
    state = TickState(n, first_pos, truth(first_pos))
    plans, committed = [], [truth(first_pos)]
    while state.committed < N:
        plan = state.plan()
        plans.append(plan)
        pos = plan.draft_pos
        if plan.branch is None and policy.branches(plan.fill, False):
            drafts = [Draft(pos, t) for t in candidates(pos, plan.fill)]
        elif plan.branch is None:
            drafts = [Draft(pos, chain_draft(pos, 0))]
        else:
            drafts = [Draft(pos, chain_draft(pos, c)) for c in range(plan.width)]
        verdict = None
        if plan.exit is not None:
            proposed = plan.proposed
            vpos = plan.verify_pos
            if proposed is None:  # n = 1: this tick's own drafts
                tokens = [d.token for d in drafts]
            else:
                tokens = list(proposed.chains) if proposed.pos == plan.branch else [proposed.token]
            hit = tokens.index(truth(vpos)) if truth(vpos) in tokens else None
            verdict = Verdict(hit is not None, truth(vpos), hit or 0)
        c = state.advance(drafts, verdict)
        if c is not None:
            committed.append(c.token)
    return state, plans, committed


def test_the_worked_example_of_the_design():
    """n = 2, the PDM's top-1 always wrong and its top-2 always right, 6 tokens: W = 1 rejects
    every draft (10 ticks); W = 2 at refill saves every branch point and the draft behind it,
    made unbranched, is rejected: branch, accept, reject (8 ticks)."""
    wrong = lambda pos, chain: truth(pos) + 1  # noqa: E731
    for W, ticks in ((1, 10), (2, 8)):
        state, plans, committed = play(2, 6, BranchPolicy(W), lambda pos, f: [truth(pos) + 1, truth(pos)], wrong)
        assert committed == [truth(50 + i) for i in range(6)]
        assert state.finish().ticks == ticks, W
        if W == 2:
            c = state.finish()
            assert c.branch_points == c.branch_saves == 3  # the first draft after the prefill is at fill 1 too


def test_chains_travel_until_the_branch_point_resolves_then_the_survivor_is_named():
    n, W = 4, 3
    # candidates: two wrong, the target's token third; every chain then drafts the target's next
    # token shifted by its row, so only the survivor's chain (row 2) stays right
    cands = lambda pos, f: [truth(pos) + 1, truth(pos) + 2, truth(pos)]  # noqa: E731
    chain = lambda pos, c: truth(pos) + (2 - c) if c < 3 else -1  # noqa: E731
    state, plans, committed = play(n, 12, BranchPolicy(W), cands, chain)
    assert committed == [truth(50 + i) for i in range(12)]
    first = next(p for p in plans if p.branch is not None)
    q = first.branch
    assert first.enter[0].chains == (truth(q) + 1, truth(q) + 2, truth(q)) and first.width == W
    # the chains' messages: every position from q on until the resolution
    chained = [p.enter[0] for p in plans if p.enter[0].chains]
    assert [e.pos for e in chained[:n - 1]] == list(range(q, q + n - 1))
    assert all(e.branch == q and len(e.chains) == W for e in chained[:n - 1])
    named = next(p.enter[0] for p in plans if p.enter[0].survivor >= 0)
    assert (named.pos, named.branch, named.survivor, named.chains) == (q + n - 1, q, 2, ())
    resolved = next(p for p in plans if p.enter[0] is named)
    assert resolved.branch is None
    assert all(e.row == 2 and e.token == truth(e.pos) for e in resolved.inflight if e.chains)
    c = state.finish()
    assert c.branch_points >= 1 and c.branch_saves == c.branch_points


def test_one_stage_verifies_its_candidates_in_the_same_tick():
    """n = 1: the branch point is this tick's own draft; nothing with chains ever enters."""
    cands = lambda pos, f: [truth(pos) + 1, truth(pos)]  # noqa: E731
    state, plans, committed = play(1, 10, BranchPolicy(2), cands, lambda pos, c: truth(pos) + 1)
    assert committed == [truth(50 + i) for i in range(10)]
    assert all(not p.enter[0].chains and p.enter[0].survivor < 0 for p in plans)
    c = state.finish()
    assert c.ticks == 9 and c.accepted == 9 and c.branch_saves == 9


@pytest.mark.parametrize("n", [1, 2, 3, 4, 6])
@pytest.mark.parametrize("when", ["refill", "always"])
def test_random_candidates_commit_the_targets_tokens(n, when):
    rng = random.Random(17 * n + len(when))
    for W in (2, 3, 4):
        hits = {}

        def cands(pos, f):
            toks = [truth(pos) + 1 + i for i in range(W)]
            if rng.random() < 0.6:  # the target's token among them, at a random row
                toks[rng.randrange(W)] = truth(pos)
            return toks

        def chain(pos, c):
            key = (pos, c)
            if key not in hits:
                hits[key] = rng.random() < 0.5
            return truth(pos) if hits[key] else truth(pos) + 7

        state, plans, committed = play(n, 60, BranchPolicy(W, when), cands, chain)
        assert committed == [truth(50 + i) for i in range(60)]
        c = state.finish()
        assert c.verified == 59 and c.branch_points >= 1
        for p in plans:  # messages carry one token or W; every position from the branch point on, W
            assert all(len(e.chains) in (0, W) for e in p.inflight)
            if p.branch is not None:
                assert p.width == W and all(len(e.chains) == W for e in p.inflight if e.pos >= p.branch)
            if when == "refill" and p.enter[0].chains and p.enter[0].pos == p.enter[0].branch:
                assert len(p.inflight) == 1 or p.inflight[-2].fill == 0  # started right after a correction


def test_candidates_must_differ():
    state = TickState(2, 5, truth(5))
    plan = state.plan()
    with pytest.raises(AssertionError, match="repeat"):
        state.advance([Draft(plan.draft_pos, 3), Draft(plan.draft_pos, 3)])

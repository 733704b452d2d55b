"""The tick protocol (engine/protocol/tick.py) on its own: the plan of each tick, the counters and the
tick formula of docs/design.md 3.3, for random verdict patterns. Pure logic, no torch."""
from __future__ import annotations

import random

import pytest

from spd_engine.engine.protocol.schedule import decode_ticks
from spd_engine.engine.protocol.tick import Draft, Entry, TickState, Verdict

pytestmark = pytest.mark.pure  # the fast tier: logic only, no process, no model file


def run(n: int, verdicts: list[bool], anchor_stages=()) -> tuple[TickState, list]:
    """Play until every verdict is used; tokens are positions * 10 (+1 for a correction)."""
    state = TickState(n, 100, 1000, anchor_stages)
    plans, used = [], 0
    while used < len(verdicts):
        plan = state.plan()
        plans.append(plan)
        verdict = None
        if plan.exit is not None:
            proposed = plan.proposed.token if plan.proposed is not None else plan.draft_pos * 10
            ok = verdicts[used]
            used += 1
            verdict = Verdict(ok, proposed if ok else proposed + 1)
        state.advance([Draft(plan.draft_pos, plan.draft_pos * 10)], verdict)
    return state, plans


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
def test_counts_follow_the_tick_formula(n):
    rng = random.Random(n)
    for _ in range(50):
        verdicts = [rng.random() < 0.6 for _ in range(rng.randint(1, 30))]
        state, _ = run(n, verdicts)
        c = state.finish()
        R = sum(1 for v in verdicts[:-1] if not v)  # the last rejection ends the run: no refill
        assert c.ticks == decode_ticks(1 + len(verdicts), n, R)
        assert (c.verified, c.accepted, c.rejections) == (len(verdicts), sum(verdicts), R)
        assert state.committed == 1 + len(verdicts)
        assert sum(c.verified_by_fill.values()) == c.verified


def test_plan_of_a_filling_then_full_pipeline():
    state, plans = run(4, [True, True, False, True])
    first = plans[0]
    assert first.enter == (Entry(100, 1000, 0, 0, 1),) and first.fill == 1
    assert [(r.pos, r.depth, r.pending) for r in first.rows] == [(100, 0, False)]
    assert first.exit is None and first.draft_pos == 101
    fourth = plans[3]  # full: x_P leaves and verifies the draft for P+1 behind it
    assert fourth.exit.pos == 100 and fourth.proposed.pos == 101 and fourth.verify_pos == 101
    assert [(r.pos, r.depth) for r in fourth.rows] == [(100, 3), (101, 2), (102, 1), (103, 0)]
    fifth = plans[4]  # the pending full-depth row of P joins, the cache grows by one
    assert fifth.rows[0].pending and fifth.rows[0].pos == 100 and fifth.pdm_pos == 100
    seventh = plans[6]  # after the rejection at tick 6: the correction enters with a new epoch
    assert seventh.enter[0].pos == 103 and seventh.enter[0].token == 1031 and seventh.enter[0].epoch == 1
    assert seventh.enter[0].fill == 0 and seventh.fill == 1 and seventh.exit is None


def test_anchor_reads_name_the_stage_that_finished_each_token_last_tick():
    _, plans = run(4, [True] * 3, anchor_stages=(0, 2, 3))  # stage 3 (the last) is never an anchor read
    assert [(s, e.pos) for s, e in plans[0].anchor_reads] == []
    assert [(s, e.pos) for s, e in plans[1].anchor_reads] == [(0, 100)]
    assert [(s, e.pos) for s, e in plans[3].anchor_reads] == [(0, 102), (2, 100)]


def test_n1_verifies_the_ticks_own_draft():
    state, plans = run(1, [True, False, True])
    assert all(p.exit is not None and p.proposed is None for p in plans)
    assert state.finish().ticks == 3


def test_misuse_is_caught():
    state = TickState(2, 0, 5)
    with pytest.raises(AssertionError):
        state.advance([Draft(1, 7)])  # advance before plan
    plan = state.plan()
    with pytest.raises(AssertionError):
        state.advance([Draft(plan.draft_pos + 1, 7)])  # a draft for the wrong position
    with pytest.raises(ValueError):
        TickState(0, 0, 0)

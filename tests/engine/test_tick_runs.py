"""Suffix runs in the tick protocol (docs/design.md 3.13): an entry of several consecutive positions,
its rows at one depth, its run verified when it leaves, several tokens committed in one tick."""
from __future__ import annotations

import pytest

from spd_engine.engine.protocol.tick import Draft, Entry, Row, TickState, Verdict


def test_design_worked_example():
    """The table of docs/design.md 3.13: n = 2, x0 at 10, a suffix draft `a` carrying `b c`, then `d`;
    the run's `c` is rejected, so tick 3 commits `b` and the correction `c'`."""
    x0, a, b, c, d, c2 = 100, 101, 102, 103, 104, 105
    st = TickState(2, 10, x0)
    p1 = st.plan()
    assert p1.rows == (Row(10, 0),) and p1.exit is None and p1.draft_pos == 11
    assert st.advance([Draft(11, a, "suffix", (b, c))]) is None

    p2 = st.plan()
    assert p2.enter[0].tokens == (a, b, c) and p2.enter[0].rows == 3 and p2.enter[0].end == 13
    assert p2.rows == (Row(10, 1), Row(11, 0), Row(12, 0), Row(13, 0))
    assert p2.exit.pos == 10 and p2.verify_pos == 11 and p2.draft_pos == 14
    committed = st.advance([Draft(14, d)], Verdict(True, a))
    assert committed.tokens == (a,) and committed.pos == 11

    p3 = st.plan()
    assert p3.rows == (Row(10, 2, True), Row(11, 1), Row(12, 1), Row(13, 1), Row(14, 0))
    assert p3.exit.tokens == (a, b, c) and p3.verify_pos == 14
    committed = st.advance([Draft(15, 999)], Verdict(False, c2, run=1))
    assert committed.pos == 12 and committed.tokens == (b, c2)  # two tokens in one tick
    assert st.committed == 4 and st.epoch == 1

    p4 = st.plan()
    assert p4.enter[0] == Entry(13, c2, 1, 0, 4) and p4.exit is None
    assert p4.rows == (Row(11, 2, True), Row(12, 2, True), Row(13, 0))  # the entry's accepted rows, full depth
    st.advance([Draft(14, d)])
    c = st.finish()
    assert (c.ticks, c.verified, c.accepted, c.rejections) == (4, 3, 2, 0)


def test_whole_run_accepted_then_the_draft_behind_it():
    """Every run token right: the tokens of the run and the draft behind it commit in one tick."""
    st = TickState(2, 0, 7)
    st.plan()
    st.advance([Draft(1, 8, "suffix", (9, 10))])
    st.plan()
    st.advance([Draft(4, 11)], Verdict(True, 8))
    plan = st.plan()
    assert plan.exit.end == 3 and plan.verify_pos == 4
    committed = st.advance([Draft(5, 12)], Verdict(True, 11, run=2))
    assert committed.pos == 2 and committed.tokens == (9, 10, 11)
    assert st.committed == 5 and st.epoch == 0
    plan = st.plan()
    assert [r.pos for r in plan.rows if r.pending] == [1, 2, 3]  # the run's three positions, full depth
    st.advance([Draft(6, 13)], Verdict(True, 12))
    counts = st.finish()
    assert (counts.verified, counts.accepted) == (5, 5)


def test_run_rejected_at_its_first_token_commits_only_the_correction():
    st = TickState(3, 0, 7)
    st.plan()
    st.advance([Draft(1, 8, "suffix", (9, 10))])
    st.plan()
    st.advance([Draft(4, 11)])
    st.plan()
    st.advance([Draft(5, 12)], Verdict(True, 8))
    st.plan()
    committed = st.advance([Draft(6, 13)], Verdict(False, 42, run=0))
    assert committed.tokens == (42,) and committed.pos == 2 and st.epoch == 1
    plan = st.plan()
    assert plan.rows[0] == Row(1, 3, True) and plan.rows[1].pos == 2  # one pending row: the entry's first


def test_runs_and_branch_points_do_not_mix():
    st = TickState(2, 0, 7)
    st.plan()
    with pytest.raises(AssertionError):
        st.advance([Draft(1, 8, "suffix", (9,)), Draft(1, 5)])


def test_a_verdict_naming_more_run_tokens_than_the_entry_carries_is_refused():
    st = TickState(2, 0, 7)
    st.plan()
    st.advance([Draft(1, 8)])
    st.plan()
    with pytest.raises(AssertionError):
        st.advance([Draft(2, 9)], Verdict(True, 8, run=1))

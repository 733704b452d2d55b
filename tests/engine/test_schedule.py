"""Tick schedule: the worked example of docs/design.md 3.3, the tick formula, and loop invariants."""
from __future__ import annotations

import random

import pytest

from spd_engine.engine.protocol.schedule import (
    CORRECTION,
    DRAFT,
    FIRST,
    STALE,
    Token,
    decode_ticks,
    eal,
    expected_eal,
    format_schedule,
    pooled_eal,
    simulate,
)

pytestmark = pytest.mark.pure  # the fast tier: logic only, no process, no model file


def tok(code: str | None) -> Token | None:
    """'x0' first token, 'd3' draft, "d'4" draft after one flush, "c'3" correction (it opens
    epoch 1), 's5' stale; primes count the epoch."""
    if code is None:
        return None
    primes = code.count("'")
    kind = {"x": FIRST, "d": DRAFT, "c": CORRECTION, "s": STALE}[code[0]]
    return Token(int(code[1 + primes:]), kind, primes)


def rows(spec: str) -> list[tuple[int, int, bool]]:
    """'0@4*,1@3' -> [(0, 4, True), (1, 3, False)]"""
    out = []
    for item in spec.split(","):
        pos, depth = item.rstrip("*").split("@")
        out.append((int(pos), int(depth), item.endswith("*")))
    return out


# docs/design.md 3.3, n=4, verdicts accept, accept, reject, (accept): tick, stages S0..S3, PDM rows,
# draft, cache end, verification (exiting, draft, accepted), committed token.
WORKED_EXAMPLE = [
    (1, ["x0", None, None, None], "0@0", "d1", 0, None, None),
    (2, ["d1", "x0", None, None], "0@1,1@0", "d2", 0, None, None),
    (3, ["d2", "d1", "x0", None], "0@2,1@1,2@0", "d3", 0, None, None),
    (4, ["d3", "d2", "d1", "x0"], "0@3,1@2,2@1,3@0", "d4", 0, ("x0", "d1", True), "d1"),
    (5, ["d4", "d3", "d2", "d1"], "0@4*,1@3,2@2,3@1,4@0", "d5", 1, ("d1", "d2", True), "d2"),
    (6, ["d5", "d4", "d3", "d2"], "1@4*,2@3,3@2,4@1,5@0", "d6", 2, ("d2", "d3", False), "c'3"),
    (7, ["c'3", "s5", "s4", "s3"], "2@4*,3@0", "d'4", 3, None, None),
    (8, ["d'4", "c'3", "s5", "s4"], "3@1,4@0", "d'5", 3, None, None),
    (9, ["d'5", "d'4", "c'3", "s5"], "3@2,4@1,5@0", "d'6", 3, None, None),
    (10, ["d'6", "d'5", "d'4", "c'3"], "3@3,4@2,5@1,6@0", "d'7", 3, ("c'3", "d'4", True), "d'4"),
]


def test_worked_example_row_by_row():
    records = simulate(4, [True, True, False, True], max_tokens=5)
    assert len(records) == len(WORKED_EXAMPLE) == decode_ticks(5, 4, 1) == 10
    for record, (tick, stages, row_spec, draft, cache_end, verify, committed) in zip(records, WORKED_EXAMPLE):
        assert record.tick == tick
        assert list(record.stages) == [tok(s) for s in stages], tick
        assert [(r.pos, r.depth, r.pending) for r in record.rows] == rows(row_spec), tick
        assert record.draft == tok(draft), tick
        assert record.cache_end == cache_end, tick
        if verify is None:
            assert record.verify is None, tick
        else:
            assert (record.verify.exiting, record.verify.draft, record.verify.accepted) == \
                   (tok(verify[0]), tok(verify[1]), verify[2]), tick
        assert record.committed == tok(committed), tick
    assert [r.tokens for r in records] == [1, 1, 1, 2, 3, 4, 4, 4, 4, 5]
    assert [r.flushed for r in records] == [t == 6 for t in range(1, 11)]


def test_worked_example_lazy_rollback():
    """Stage s cuts its KV back to P+3 when c_{P+3} reaches it, at tick 7+s, and at no other time."""
    records = simulate(4, [True, True, False, True], max_tokens=5)
    for record in records:
        expected = tuple(3 if record.tick == 7 + s else None for s in range(4))
        assert record.rollback == expected, record.tick


def test_worked_example_table():
    table = format_schedule(simulate(4, [True, True, False, True], max_tokens=5)).splitlines()
    assert table[0] == "| tick | S0 | S1 | S2 | S3 | PDM rows -> draft | verify | result |"
    assert table[2] == "| 1 | x_P | | | | [P@0] -> d_{P+1}; cache 0..P-1 | | |"
    assert table[5] == ("| 4 | d_{P+3} | d_{P+2} | d_{P+1} | x_P | [P@3, P+1@2, P+2@1, P+3@0] -> d_{P+4} "
                        "| logits(x_P) vs d_{P+1}: accept | emit P+1 |")
    assert table[7] == ("| 6 | d_{P+5} | d_{P+4} | d_{P+3} | d_{P+2} | [P+1@4*, P+2@3, P+3@2, P+4@1, P+5@0] "
                        "-> d_{P+6}; cache 0..P+1 | logits(d_{P+2}) vs d_{P+3}: reject "
                        "| emit c_{P+3}, flush; d_{P+6} dropped |")
    assert table[8] == "| 7 | c_{P+3} | (stale) | (stale) | (stale) | [P+2@4*, P+3@0] -> d'_{P+4}; cache 0..P+2 | | |"
    assert table[9] == "| 8 | d'_{P+4} | c_{P+3} | (stale) | (stale) | [P+3@1, P+4@0] -> d'_{P+5} | | |"
    assert len(table) == 12


def test_single_stage_table_drops_nothing():
    table = format_schedule(simulate(1, [False, True]))
    assert "emit c_{P+1}, flush |" in table and "dropped" not in table
    assert format_schedule(simulate(3, [], max_tokens=1)).startswith("(no decode ticks")


def check_invariants(n: int, records, verdicts) -> None:
    """Bookkeeping every tick must satisfy, replayed independently of the simulator's own state."""
    committed = {0: Token(0, FIRST, 0)}  # position -> committed token, x_P first
    kv = [[] for _ in range(n)]  # per stage: token written at each position offset
    for record in records:
        assert len(record.stages) == n
        live = [(p, t) for p, t in enumerate(record.stages) if t is not None and t.kind != STALE]
        assert live and live[0][0] == 0  # stage 0 always holds the newest live token
        live_tokens = [t for _, t in live]
        # the staircase: live tokens at consecutive positions, depth = stage, newest at depth 0
        assert [t.position for _, t in live] == list(range(live[0][1].position, live[0][1].position - len(live), -1))
        stair = [r for r in record.rows if not r.pending]
        assert [(r.pos, r.depth) for r in stair] == [(t.position, p) for p, t in reversed(live)]
        pending = [r for r in record.rows if r.pending]
        assert len(pending) <= 1 and record.rows[:len(pending)] == tuple(pending)
        if pending:  # the pending row is the newest verified position, at full depth
            assert pending[0].depth == n and pending[0].pos == record.cache_end - 1
        # PDM cache + rows cover positions without gap, and only verified positions are cached
        assert stair[0].pos == record.cache_end
        assert record.cache_end <= len(committed)
        assert record.draft.position == live[0][1].position + 1
        # stages: lazy rollback, then write; a live token only ever sees committed tokens below it
        for p, t in enumerate(record.stages):
            if t is None:
                continue
            if record.rollback[p] is not None:
                assert record.rollback[p] == t.position < len(kv[p])
                del kv[p][t.position:]
            assert len(kv[p]) == t.position
            if t.kind != STALE:  # below it: committed tokens, or live drafts further down the pipe
                assert all(committed.get(w.position) == w or w in live_tokens for w in kv[p])
            kv[p].append(t)
        if record.verify is not None:
            assert record.verify.exiting == record.stages[-1] and record.verify.exiting.position in committed
            assert record.verify.draft.position == record.verify.exiting.position + 1
            assert record.verify.accepted == verdicts[len(committed) - 1]
            committed[record.committed.position] = record.committed
            assert record.committed.kind == (DRAFT if record.verify.accepted else CORRECTION)
        else:
            assert record.committed is None
        assert record.tokens == len(committed)
    assert sorted(committed) == list(range(len(committed)))  # one token per position, no gap


@pytest.mark.parametrize("n", range(1, 9))
def test_tick_formula_matches_simulation(n):
    rng = random.Random(n)
    for _ in range(40):
        alpha = rng.random()
        max_tokens = rng.randint(1, 40)
        verdicts = [rng.random() < alpha for _ in range(max_tokens - 1)]
        records = simulate(n, verdicts, max_tokens)
        check_invariants(n, records, verdicts)
        rejections = sum(r.flushed for r in records[:-1])  # a rejection on the last tick costs no refill
        assert len(records) == decode_ticks(max_tokens, n, rejections)
        assert (records[-1].tokens if records else 1) == max_tokens


def test_ending_correction_costs_no_refill():
    records = simulate(4, [True, False], max_tokens=3)
    assert len(records) == 5 == decode_ticks(3, 4, 0)
    assert records[-1].flushed


def test_simulate_validates():
    with pytest.raises(ValueError, match="verdicts"):
        simulate(4, [True], max_tokens=5)
    with pytest.raises(ValueError, match="n must be"):
        simulate(0, [True])
    with pytest.raises(ValueError, match="max_tokens"):
        simulate(2, [], max_tokens=0)


def test_decode_ticks_small_cases():
    assert decode_ticks(1, 8, 0) == 0
    assert decode_ticks(2, 1, 0) == 1
    assert decode_ticks(2, 4, 0) == 4  # fill of 3 ticks, then one verification
    assert decode_ticks(5, 4, 1) == 10
    for bad in [(0, 4, 0), (3, 0, 0), (3, 4, 2), (5, 4, -1)]:
        with pytest.raises(ValueError):
            decode_ticks(*bad)


def test_eal_definitions():
    assert eal(4, 4, 10) == pytest.approx(1.6)
    assert eal(1, 7, 7) == 1.0
    assert pooled_eal(4, [5, 1, 3], [10, 0, 5]) == pytest.approx(4 * 6 / 15)
    assert eal(4, 0, 0) != eal(4, 0, 0)  # nan: nothing decoded
    with pytest.raises(ValueError):
        eal(4, 3, 0)
    assert expected_eal(4, 1.0) == 4 and expected_eal(4, 0.0) == 1
    with pytest.raises(ValueError):
        expected_eal(4, 1.5)


@pytest.mark.parametrize("n, alpha", [(4, 0.7), (8, 0.5)])
def test_expected_eal_matches_long_runs(n, alpha):
    rng = random.Random(7)
    verdicts = [rng.random() < alpha for _ in range(5000)]
    records = simulate(n, verdicts)
    assert eal(n, records[-1].tokens - 1, len(records)) == pytest.approx(expected_eal(n, alpha), rel=0.03)

"""Several requests in the pipeline: the row policy (engine/protocol/batch_policy.py), the worked example of
docs/design.md 3.12 tick by tick, and the stage utilization (engine/protocol/batch_schedule.py). Pure logic."""
from __future__ import annotations

import random
from pathlib import Path

import pytest

from spd_engine.engine.protocol.batch_policy import BATCH, CRITICAL, BatchLimits, RequestView, plan_rows
from spd_engine.engine.protocol.batch_schedule import (
    PROMPT,
    RequestScript,
    format_batch,
    format_utilization,
    label,
    simulate_batch,
    utilization,
)
from spd_engine.engine.protocol.schedule import decode_ticks, simulate

pytestmark = pytest.mark.pure


# ---- the policy on its own ----

def view(rid: int, **kw) -> RequestView:
    return RequestView(rid, kw.pop("arrival", rid), **kw)


def test_running_requests_always_enter_and_critical_rows_are_reserved():
    limits = BatchLimits(max_batch=4, max_rows=2, prefill_rows=8)
    # the critical request 0 waits with a correction; batch 1 runs; batch 2 and 3 wait
    reqs = [view(0, latency=CRITICAL), view(1, fill=3), view(2), view(3)]
    plan = plan_rows(reqs, limits)
    assert plan.enter == (1, 0) and plan.started == (0,) and plan.held == (2, 3) and plan.rows == 2
    # the critical request still in prefill: its row stays reserved, no batch request starts in it
    reqs = [view(0, latency=CRITICAL, prompt_left=5, ready=False), view(1, fill=3), view(2)]
    plan = plan_rows(reqs, limits)
    assert plan.enter == (1,) and plan.held == (2,) and plan.prefill == ((0, 5),)
    # without a critical request the free row goes to the batch request of higher priority, then the earlier
    plan = plan_rows([view(1, fill=3), view(2), view(3, priority=1)], limits)
    assert plan.started == (3,) and plan.held == (2,)
    plan = plan_rows([view(1, fill=3), view(2, arrival=9), view(3, arrival=5)], limits)
    assert plan.started == (3,)


def test_a_critical_request_joining_full_rows_waits_for_a_rejection_without_preemption():
    limits = BatchLimits(max_batch=3, max_rows=2, prefill_rows=1)
    reqs = [view(0, fill=4), view(1, fill=2), view(2, latency=CRITICAL)]
    plan = plan_rows(reqs, limits)
    assert plan.enter == (0, 1) and plan.held == (2,)
    # request 1 was rejected: its row goes to the critical request, not back to it
    plan = plan_rows([view(0, fill=4), view(1), view(2, latency=CRITICAL)], limits)
    assert plan.enter == (0, 2) and plan.held == (1,)


def test_strict_order_and_wide_requests():
    limits = BatchLimits(max_batch=3, max_rows=3, prefill_rows=1)
    # request 1 (W = 3 rows) does not fit beside the running one: the later narrow one does not overtake it
    plan = plan_rows([view(0, fill=1), view(1, rows=3), view(2)], limits)
    assert plan.started == () and plan.held == (1, 2)
    with pytest.raises(ValueError, match="exceed max_rows"):
        plan_rows([view(0, rows=4)], limits)


def test_prefill_chunks_are_bounded_and_ordered():
    limits = BatchLimits(max_batch=3, max_rows=1, prefill_rows=6)
    reqs = [view(0, fill=1), view(1, prompt_left=4, ready=False), view(2, prompt_left=9, ready=False, priority=2)]
    plan = plan_rows(reqs, limits)
    assert plan.prefill == ((2, 6),) and plan.prefill_tokens == 6 and plan.rows == 1
    plan = plan_rows([view(0, fill=1), view(1, prompt_left=4, ready=False), view(2, prompt_left=1, ready=False)],
                     limits)
    assert plan.prefill == ((1, 4), (2, 1))
    # a critical newcomer's prompt goes first, whatever its arrival and the others' priority
    plan = plan_rows([view(1, prompt_left=4, ready=False, priority=5),
                      view(2, prompt_left=9, ready=False, latency=CRITICAL)], limits)
    assert plan.prefill == ((2, 6),)


@pytest.mark.parametrize("bad, field", [
    (dict(max_batch=0, max_rows=1, prefill_rows=1), "max_batch"),
    (dict(max_batch=1, max_rows=0, prefill_rows=1), "max_rows"),
    (dict(max_batch=1, max_rows=1, prefill_rows=0), "prefill_rows"),
    (dict(max_batch=1, max_rows=1.5, prefill_rows=1), "max_rows"),
])
def test_limits_are_validated(bad, field):
    with pytest.raises(ValueError, match=field):
        BatchLimits(**bad)


def test_views_are_validated():
    with pytest.raises(ValueError, match="latency"):
        view(0, latency="urgent")
    with pytest.raises(ValueError, match="fill"):
        view(0, fill=-1)
    with pytest.raises(ValueError, match="rows"):
        view(0, rows=0)
    with pytest.raises(ValueError, match="prompt tokens are unsent"):
        view(0, prompt_left=3)
    with pytest.raises(ValueError, match="not ready"):
        view(0, fill=2, ready=False)
    limits = BatchLimits(1, 1, 1)
    with pytest.raises(ValueError, match="max_batch"):
        plan_rows([view(0), view(1)], limits)
    with pytest.raises(ValueError, match="unique"):
        plan_rows([view(0), view(0, arrival=5)], BatchLimits(2, 2, 1))
    with pytest.raises(ValueError, match="critical requests need 2 rows"):
        plan_rows([view(0, latency=CRITICAL), view(1, latency=CRITICAL)], BatchLimits(2, 1, 1))
    with pytest.raises(ValueError, match="running requests hold"):
        plan_rows([view(0, fill=1), view(1, fill=1)], BatchLimits(2, 1, 1))


# ---- the worked example of docs/design.md 3.12 ----

A = RequestScript("A", (True, True, False, True), CRITICAL)  # 3.3's request: accept, accept, reject, accept
B = RequestScript("B", (True,) * 7)  # background: every draft accepted
LIMITS = BatchLimits(max_batch=2, max_rows=2, prefill_rows=128)

# tick, S0..S3 as "A / B", rows entering stage 0, A's and B's verification
WORKED_EXAMPLE = """\
| tick | S0 (A / B) | S1 (A / B) | S2 (A / B) | S3 (A / B) | rows | A (critical) | B (batch) |
|---|---|---|---|---|---|---|---|
| 1 | x_P / x_P | - / - | - / - | - / - | 2 | | |
| 2 | d_{P+1} / d_{P+1} | x_P / x_P | - / - | - / - | 2 | | |
| 3 | d_{P+2} / d_{P+2} | d_{P+1} / d_{P+1} | x_P / x_P | - / - | 2 | | |
| 4 | d_{P+3} / d_{P+3} | d_{P+2} / d_{P+2} | d_{P+1} / d_{P+1} | x_P / x_P | 2 | accept: emit P+1 | accept: emit P+1 |
| 5 | d_{P+4} / d_{P+4} | d_{P+3} / d_{P+3} | d_{P+2} / d_{P+2} | d_{P+1} / d_{P+1} | 2 | accept: emit P+2 | accept: emit P+2 |
| 6 | d_{P+5} / d_{P+5} | d_{P+4} / d_{P+4} | d_{P+3} / d_{P+3} | d_{P+2} / d_{P+2} | 2 | reject: emit c_{P+3}, flush | accept: emit P+3 |
| 7 | c_{P+3} / d_{P+6} | (stale) / d_{P+5} | (stale) / d_{P+4} | (stale) / d_{P+3} | 2 | | accept: emit P+4 |
| 8 | d'_{P+4} / d_{P+7} | c_{P+3} / d_{P+6} | (stale) / d_{P+5} | (stale) / d_{P+4} | 2 | | accept: emit P+5 |
| 9 | d'_{P+5} / d_{P+8} | d'_{P+4} / d_{P+7} | c_{P+3} / d_{P+6} | (stale) / d_{P+5} | 2 | | accept: emit P+6 |
| 10 | d'_{P+6} / d_{P+9} | d'_{P+5} / d_{P+8} | d'_{P+4} / d_{P+7} | c_{P+3} / d_{P+6} | 2 | accept: emit P+4 | accept: emit P+7 |"""


def test_worked_example_tick_by_tick():
    run = simulate_batch(4, [A, B], LIMITS)
    assert format_batch(run) == WORKED_EXAMPLE
    assert [(r.name, r.first_entry_tick, r.done_tick, r.tokens, r.own_ticks) for r in run.requests] == [
        ("A", 1, 10, 5, decode_ticks(5, 4, 1)), ("B", 1, 10, 8, decode_ticks(8, 4, 0))]


def test_the_design_doc_shows_this_table():
    text = (Path(__file__).resolve().parents[2] / "docs" / "design.md").read_text()
    section = text[text.index("### 3.12 "):text.index("## 4. Layout")]
    assert WORKED_EXAMPLE in section


def test_the_critical_request_keeps_its_single_stream_schedule():
    """A's rows in the batched run are 3.3's table, stage by stage and tick by tick."""
    solo = simulate(4, A.verdicts, max_tokens=5)
    for batch in (simulate_batch(4, [A, B], LIMITS), simulate_batch(4, [B, A], LIMITS),
                  simulate_batch(4, [A, B], BatchLimits(2, 1, 1))):  # even with one row per stage step
        for record, bt in zip(solo, batch.ticks):
            mine = [next((r.token for r in rows if r.request == "A"), None) for rows in bt.stages]
            assert mine == list(record.stages), bt.tick


def test_worked_example_utilization():
    alone = utilization(simulate_batch(4, [A], LIMITS))
    assert alone.useful == (10, 8, 6, 4) and alone.ticks == 10  # S3: 3 fill ticks and 3 stale ones
    assert alone.overall == pytest.approx(0.70) and alone.per_stage == (1.0, 0.8, 0.6, 0.4)
    both = utilization(simulate_batch(4, [A, B], LIMITS))
    assert both.useful == (10, 9, 8, 7) and both.overall == pytest.approx(0.85)  # only the initial fill is idle
    # every step after the fill carries two rows; A's stale ones (1, 2, 3 at S1..S3) are the only waste
    assert both.rows == (20, 18, 16, 14) and both.live_rows == (20, 17, 14, 11) and both.rows_per_step == 2.0
    assert format_utilization(both) == "S0 10/10, S1 9/10, S2 8/10, S3 7/10; overall 34/40 = 0.85"
    # one row per stage step: B waits for A's row, and A's bubbles stay empty
    serial = simulate_batch(4, [A, B], BatchLimits(2, 1, 1))
    assert [(r.first_entry_tick, r.done_tick) for r in serial.requests] == [(1, 10), (11, 20)]
    u = utilization(serial)
    assert u.useful == (20, 17, 14, 11) and u.rows_per_step == 1.0
    assert utilization(serial, 1, 10).useful == alone.useful
    with pytest.raises(ValueError, match="inside the run"):
        utilization(serial, 5, 21)


def test_a_newcomer_prefills_in_bounded_chunks_beside_decoding():
    C = RequestScript("C", (True, True), prompt=5, arrival_tick=2)
    run = simulate_batch(4, [A, C], BatchLimits(2, 2, 2))
    chunks = [(bt.tick, label(r)) for bt in run.ticks for r in bt.stages[0] if r.token.kind == PROMPT]
    assert chunks == [(2, "prompt P-5..P-4"), (3, "prompt P-3..P-2"), (4, "prompt P-1..P-1")]
    assert all(sum(r.rows for r in rows) <= 2 + 2 for bt in run.ticks for rows in bt.stages)
    c = run.requests[1]
    # the last chunk leaves stage 3 at tick 7 with x_P; x_P enters at tick 8
    assert (c.live_tick, c.first_token_tick, c.first_entry_tick) == (2, 7, 8)
    solo = simulate(4, A.verdicts, max_tokens=5)  # A never waits for the prefill
    assert [next(r.token for r in bt.stages[0] if r.request == "A") for bt in run.ticks[:10]] == \
        [record.stages[0] for record in solo]


def test_slots_of_max_batch_are_reused():
    reqs = [RequestScript(f"r{i}", (True, False, True), arrival_tick=1) for i in range(3)]
    run = simulate_batch(2, reqs, BatchLimits(2, 2, 1))
    r0, r1, r2 = run.requests
    assert r2.live_tick == max(r0.done_tick, r1.done_tick) + 1 or r2.live_tick == min(r0.done_tick, r1.done_tick) + 1
    assert all(len({r.request for r in bt.stages[0]}) <= 2 for bt in run.ticks)


@pytest.mark.parametrize("n", [1, 2, 4])
def test_every_request_follows_the_tick_formula_under_any_limits(n):
    rng = random.Random(n)
    for _ in range(20):
        scripts = [RequestScript(f"r{i}", tuple(rng.random() < 0.6 for _ in range(rng.randint(1, 12))),
                                 CRITICAL if i == 0 else BATCH, rng.randint(0, 2), rng.randint(1, 6),
                                 rng.choice([0, 0, 3, 9])) for i in range(rng.randint(1, 5))]
        limits = BatchLimits(rng.randint(1, 4), rng.randint(1, 3), rng.randint(1, 4))
        run = simulate_batch(n, scripts, limits)
        for s, r in zip(scripts, run.requests):
            rejections = sum(1 for v in s.verdicts[:-1] if not v)
            assert r.tokens == s.goal and r.own_ticks == decode_ticks(s.goal, n, rejections)
        for bt in run.ticks:
            assert bt.plan.rows <= limits.max_rows and bt.plan.prefill_tokens <= limits.prefill_rows
            assert all(sum(r.rows for r in rows) <= limits.max_rows + limits.prefill_rows for rows in bt.stages)


def test_a_request_with_nothing_to_decode_never_enters():
    run = simulate_batch(2, [RequestScript("x", (), arrival_tick=3), RequestScript("y", (), prompt=2)],
                         BatchLimits(2, 2, 2))
    assert all(r.token.kind == PROMPT for bt in run.ticks for rows in bt.stages for r in rows)
    assert [(r.tokens, r.own_ticks, r.done_tick) for r in run.requests] == [(1, 0, 2), (1, 0, 2)]


def test_scripts_are_validated():
    with pytest.raises(ValueError, match="tokens"):
        RequestScript("x", (True,), tokens=3)
    with pytest.raises(ValueError, match="arrival_tick"):
        RequestScript("x", (), arrival_tick=0)
    with pytest.raises(ValueError, match="latency"):
        RequestScript("x", (), latency="now")
    with pytest.raises(ValueError, match="unique"):
        simulate_batch(2, [A, A], LIMITS)
    with pytest.raises(ValueError, match="n must be"):
        simulate_batch(0, [A], LIMITS)

"""The row bound inside the runtime (engine/runtime/batch_driver.py over engine/protocol/batch_policy.py,
docs/design.md 3.12): with fewer decode rows per stage step than live requests, a request whose
pipeline holds none of its live tokens may be held back a tick, which for it is a tick that did
not happen, so every request still equals itself alone (tokens, ticks, verifications); a
latency-critical request is never held, and the bound is never exceeded.
"""
from __future__ import annotations

import pytest
from helpers import CHUNK, random_prompts, solo_results, summary, tiny_engine_config

from spd_engine.engine.protocol.batch_policy import CRITICAL
from spd_engine.engine.protocol.sampling import SamplingParams
from spd_engine.engine.runtime.batch_driver import BatchRequest
from spd_engine.engine.runtime.launch import launch
from spd_engine.engine.runtime.reference import ReferenceExecutor

NEW = 20


def requests(ecfg, critical: int | None = None, seeded: bool = False) -> list[BatchRequest]:
    """Four requests arriving at ticks 1, 2, 4, 6, the one at index `critical` latency-critical."""
    prompts = random_prompts(ecfg.model.cfg, (5, CHUNK + 3, 9, 4), seed=21)
    out = []
    for i, p in enumerate(prompts):
        sp = SamplingParams(temperature=1.0, top_k=4, seed=30 + i) if seeded and i % 2 else SamplingParams()
        out.append(BatchRequest(p, NEW - 3 * (i == 3), sampling=sp, arrival_tick=(1, 2, 4, 6)[i],
                                latency=CRITICAL if i == critical else "batch"))
    return out



@pytest.mark.parametrize("n,colocate", [(2, True), (2, False), (4, False), (4, True)])
def test_every_request_equals_itself_alone_under_a_row_bound(n, colocate, one_thread):
    ecfg = tiny_engine_config("llama", n, colocate)
    reqs = requests(ecfg)
    with ReferenceExecutor(ecfg) as ex:
        alone = [summary(r) for r in solo_results(ex, reqs)]
        for max_rows in (1, 2):
            out = ex.generate_batch(reqs, 4, max_rows=max_rows)
            assert [summary(r) for r in out.results] == alone, (n, colocate, max_rows)
            assert max(out.rows) == max_rows  # the bound was reached and never passed
            assert sum(out.held) > 0 and sum(out.held_ticks) == sum(out.held)  # it really held requests back
        free = ex.generate_batch(reqs, 4)
    assert sum(free.held) == 0 and max(free.rows) == 4  # the default: every live request every tick


@pytest.mark.parametrize("n", [2, 4])
def test_a_critical_request_is_never_held(n, one_thread):
    """The critical request (the third, arriving while the others decode) keeps its single-stream
    schedule: it never waits for a row, while batch requests do."""
    ecfg = tiny_engine_config("qwen2", n, True)
    reqs = requests(ecfg, critical=2, seeded=True)
    with ReferenceExecutor(ecfg) as ex:
        alone = [summary(r) for r in solo_results(ex, reqs)]
        out = ex.generate_batch(reqs, 4, max_rows=2)
    assert [summary(r) for r in out.results] == alone
    assert out.held_ticks[2] == 0 and sum(out.held_ticks) > 0, out.held_ticks
    assert max(out.rows) <= 2


def test_critical_requests_beyond_the_bound_wait_for_a_slot(one_thread):
    """Two critical requests and one row: the second takes a slot only when the first has left."""
    ecfg = tiny_engine_config("llama", 2, True)
    reqs = [BatchRequest(r.prompt, r.max_new_tokens, arrival_tick=r.arrival_tick, latency=CRITICAL)
            for r in requests(ecfg)[:2]]
    with ReferenceExecutor(ecfg) as ex:
        alone = [summary(r) for r in solo_results(ex, reqs)]
        out = ex.generate_batch(reqs, 2, max_rows=1)
    assert [summary(r) for r in out.results] == alone
    assert out.held_ticks == [0, 0] and max(out.rows) == 1


def test_bad_bounds_and_classes_are_refused(one_thread):
    ecfg = tiny_engine_config("llama", 2, True)
    r = requests(ecfg)[0]
    with ReferenceExecutor(ecfg) as ex:
        with pytest.raises(ValueError, match="latency"):
            ex.generate_batch([BatchRequest(r.prompt, 4, latency="urgent")], 2)
        with pytest.raises(ValueError, match="priority"):
            ex.generate_batch([BatchRequest(r.prompt, 4, priority=1.5)], 2)
        with pytest.raises(ValueError, match="max_rows"):
            ex.generate_batch([r], 2, max_rows=0)
    ecfg2 = tiny_engine_config("llama", 2, True, branches=2)
    with ReferenceExecutor(ecfg2) as ex:
        with pytest.raises(ValueError, match="branch width"):
            ex.generate_batch([r], 2, max_rows=1)


@pytest.mark.multiproc
def test_processes_equal_threads_under_a_row_bound():
    ecfg = tiny_engine_config("qwen2", 2, True, threads=1)
    reqs = requests(ecfg, critical=1)
    with ReferenceExecutor(ecfg) as ex:
        want = ex.generate_batch(reqs, 3, max_rows=2)
    with launch(ecfg) as runtime:
        got = runtime.generate_batch(reqs, 3, max_rows=2)
    assert [summary(r) for r in got.results] == [summary(r) for r in want.results]
    # who waits when depends on when prefill reports arrive (a newcomer's readiness), not the outputs
    assert max(got.rows) <= 2 and got.held_ticks[1] == 0

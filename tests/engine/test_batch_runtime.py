"""Several requests in the pipeline at once (engine/runtime/batch_driver.py, docs/design.md 3.12):
every request's output equals its own solo output, greedy and seeded, whatever shares the stages
with it, joins or leaves; a rejection flushes only its own request, so each request's ticks,
verifications and acceptances are what it does alone.
"""
from __future__ import annotations

import pytest
from helpers import (
    CHUNK,
    Policy,
    assert_processes_equal_threads,
    random_prompts,
    reference,
    solo_results,
    summary,
    tiny_engine_config,
)

from spd_engine.engine.protocol.sampling import SamplingParams
from spd_engine.engine.runtime.batch_driver import BatchRequest
from spd_engine.engine.runtime.reference import ReferenceExecutor

NEW = 24


def requests(ecfg, policies: bool = True) -> list[BatchRequest]:
    """Four requests: prompts of one to three prefill chunks, arriving at different ticks, of
    different lengths (so they leave at different ticks); with `policies`, the second accepts
    every draft and the third rejects three, the others draft with the untrained PDM."""
    prompts = random_prompts(ecfg.model.cfg, (5, 2 * CHUNK + 3, 9, CHUNK + 1), seed=3)
    lengths = (NEW, NEW - 7, NEW, 9)
    out = []
    for i, (p, new) in enumerate(zip(prompts, lengths)):
        policy = None
        if policies and i in (1, 2):
            policy = Policy(reference(ecfg, p, new), len(p), ecfg.model.cfg.vocab_size,
                            wrong=frozenset({2, 3, 11}) if i == 2 else frozenset())
        out.append(BatchRequest(p, new, arrival_tick=1 + 4 * i, draft_policy=policy))
    return out



@pytest.mark.parametrize("n,colocate", [(2, False), (2, True), (4, False), (4, True)])
def test_every_request_equals_itself_alone_at_every_batch_size(n, colocate, one_thread):
    ecfg = tiny_engine_config("llama", n, colocate)
    reqs = requests(ecfg)
    with ReferenceExecutor(ecfg) as ex:
        alone = [summary(r) for r in solo_results(ex, reqs)]
        for r, got in zip(reqs, alone):
            assert got["tokens"] == reference(ecfg, r.prompt, r.max_new_tokens)
        for B in (1, 2, 4):
            out = ex.generate_batch(reqs, B)
            # tokens, ticks, verified, accepted, rejections: a flush touches its own request only
            assert [summary(r) for r in out.results] == alone, (n, colocate, B)
            assert max(out.rows) == min(B, len(reqs))  # B requests really shared stage steps
            u = out.utilization
            assert all(lr <= r for lr, r in zip(u.live_rows, u.rows)) and all(k <= u.ticks for k in u.useful)
    assert any(s["rejections"] >= 3 for s in alone) and any(s["accepted"] == s["verified"] > 0 for s in alone)


def test_batching_shortens_the_run_and_fills_stage_steps(one_thread):
    ecfg = tiny_engine_config("llama", 4, False)
    reqs = [BatchRequest(r.prompt, r.max_new_tokens) for r in requests(ecfg, policies=False)]
    with ReferenceExecutor(ecfg) as ex:
        one, four = ex.generate_batch(reqs, 1), ex.generate_batch(reqs, 4)
    assert [r.tokens for r in one.results] == [r.tokens for r in four.results]
    assert four.ticks < 0.6 * one.ticks
    # rows per busy stage step grow with B; the share of useful stage-ticks does not fall
    assert sum(four.utilization.rows) / sum(four.utilization.steps) > 1.5
    assert four.utilization.overall >= one.utilization.overall


def seeded_requests(ecfg) -> list[BatchRequest]:
    """Three seeded requests (temperatures, top-k and seeds of their own, one past int64) arriving
    at different ticks."""
    prompts = random_prompts(ecfg.model.cfg, (6, CHUNK + 4, 3), seed=8)
    return [BatchRequest(p, NEW, sampling=SamplingParams(temperature=t, top_k=k, seed=s), arrival_tick=1 + 2 * i)
            for i, (p, t, k, s) in enumerate(zip(prompts, (1.0, 0.7, 1.3), (0, 20, 0), (5, 6, 2**63 + 9)))]


@pytest.mark.parametrize("n,colocate", [(2, True), (4, False)])
def test_seeded_sampling_equals_itself_alone(n, colocate, one_thread):
    ecfg = tiny_engine_config("qwen2", n, colocate)
    reqs = seeded_requests(ecfg)
    with ReferenceExecutor(ecfg) as ex:
        alone = [summary(r) for r in solo_results(ex, reqs)]
        out = ex.generate_batch(reqs, 3)
    assert [summary(r) for r in out.results] == alone


def test_suffix_drafts_stay_per_request(one_thread):
    ecfg = tiny_engine_config("qwen3", 2, True, suffix_drafts=True, suffix_min_match=1)
    reqs = [BatchRequest(r.prompt, r.max_new_tokens, arrival_tick=r.arrival_tick)
            for r in requests(ecfg, policies=False)]
    with ReferenceExecutor(ecfg) as ex:
        alone = [summary(r) for r in solo_results(ex, reqs)]
        out = ex.generate_batch(reqs, 2)
    assert [summary(r) for r in out.results] == alone
    assert sum(r.by_source.get("suffix", [0])[0] for r in out.results) > 0  # the suffix source really drafted


@pytest.mark.multiproc
def test_processes_equal_the_reference_executor():
    ecfg = tiny_engine_config("qwen2", 3, False, threads=1)
    assert_processes_equal_threads(ecfg, requests(ecfg))


def test_bad_batch_runs_are_refused_before_any_work(one_thread):
    ecfg = tiny_engine_config("llama", 2, False)
    ok = BatchRequest([1, 2, 3], 4)
    with ReferenceExecutor(ecfg) as ex:
        with pytest.raises(ValueError, match="max_batch must be >= 1"):
            ex.generate_batch([ok], 0)
        with pytest.raises(ValueError, match="exceeds the KV cache capacity"):
            ex.generate_batch([ok, BatchRequest([1] * 10, ecfg.runtime.capacity)], 2)
        with pytest.raises(ValueError, match="arrival_tick must be >= 1"):
            ex.generate_batch([BatchRequest([1], 2, arrival_tick=0)], 2)
        assert ex.generate_batch([ok], 2).results[0].tokens == reference(ecfg, ok.prompt, 4)


def test_utilization_counts_each_rejections_stale_rows(one_thread):
    """At n = 2 alone, each rejection leaves one stale row at stage 1 the tick after (3.3); the run's
    last rejection may end it before that step."""
    ecfg = tiny_engine_config("llama", 2, False)
    reqs = [BatchRequest(r.prompt, r.max_new_tokens) for r in requests(ecfg, policies=False)]
    runs = []
    with ReferenceExecutor(ecfg) as ex:
        for r in reqs:
            out = ex.generate_batch([r], 1)
            u, rejections = out.utilization, out.results[0].rejections
            assert u.live_rows[0] == u.rows[0] == u.steps[0]  # stage 0 only ever holds live tokens
            assert rejections - 1 <= u.rows[1] - u.live_rows[1] <= rejections and rejections > 0
            runs.append(u)
        life = ex.batch.lifetime  # a server's /metrics: every run's counts, summed
    assert life.ticks == sum(u.ticks for u in runs)
    for field in ("useful", "rows", "live_rows", "steps"):
        assert getattr(life, field) == [sum(getattr(u, field)[p] for u in runs) for p in range(2)], field

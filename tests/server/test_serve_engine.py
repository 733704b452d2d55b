"""The engine thread of `spd serve` on the real runtime in one process (ReferenceExecutor: the
driver and stage workers of a distributed run, in one process): FIFO requests stay lossless,
a stop string or a cancel ends the request at that token, and the next request is unaffected; with
--max-batch a critical request takes a free slot first and stays lossless beside batch ones."""
from __future__ import annotations

import asyncio
import re
import threading

import pytest
from helpers import random_prompts, reference, tiny_engine_config

from spd_engine.engine.protocol.sampling import SamplingParams
from spd_engine.engine.runtime.reference import ReferenceExecutor
from spd_engine.server.engine_loop import EngineLoop
from spd_engine.server.exporter import ServeMetrics
from spd_engine.server.job import Job
from spd_engine.server.openai_api import ParsedRequest
from spd_engine.server.request import ServeRequest

NEW = 40


@pytest.fixture(scope="module")
def setup():
    ecfg = tiny_engine_config("llama", 3)
    prompts = random_prompts(ecfg.model.cfg, [5, 9, 21])
    refs = [reference(ecfg, p, NEW) for p in prompts]
    engine = EngineLoop(lambda: ReferenceExecutor(ecfg), queue_limit=4, eos_ids=())
    engine.start(timeout=60)
    yield engine, prompts, refs
    assert engine.stop(timeout=30)


def request(prompt: list[int], stops: tuple[str, ...] = (), latency: str = "batch", priority: int = 0) -> ServeRequest:
    parsed = ParsedRequest(chat=False, model="m", prompt=prompt, latency=latency, priority=priority)
    return ServeRequest(list(prompt), NEW, SamplingParams(), stops, parsed)


async def collect(job: Job, cancel_after: int | None = None, engine: EngineLoop | None = None) -> tuple[str, tuple]:
    text = []
    while (event := await job.events.get())[0] == "piece":
        text.append(event[1])
        if cancel_after is not None and len(text) == cancel_after:
            engine.cancel(job)
    return "".join(text), event


def ids(text: str) -> list[int]:
    return [int(x) for x in text.split()]


def test_queued_requests_run_in_order_and_stay_lossless(setup):
    engine, prompts, refs = setup

    async def main():
        jobs = [Job(request(p), None, asyncio.get_running_loop()) for p in prompts]
        for job in jobs:
            engine.submit(job)
        return [await collect(job) for job in jobs], jobs

    outs, jobs = asyncio.run(main())
    for (text, done), job, ref in zip(outs, jobs, refs):
        assert ids(text) == ref == job.result.tokens
        assert done[1].finish_reason == "length" and done[1].completion_tokens == NEW
    assert jobs[0].started < jobs[1].started < jobs[2].started


def test_stop_string_ends_the_request_at_that_token(setup):
    engine, prompts, refs = setup
    ref = refs[1]
    text_of = lambda toks: "".join(f"{t} " for t in toks)  # noqa: E731 - how IdText writes ids
    # a token at k >= 3 whose text first occurs in the reply right there
    k = next(i for i in range(3, NEW) if text_of(ref[:i + 1]).find(f"{ref[i]} ") == len(text_of(ref[:i])))
    stop = f"{ref[k]} "

    async def main():
        loop = asyncio.get_running_loop()
        job, after = Job(request(prompts[1], (stop,)), None, loop), Job(request(prompts[2]), None, loop)
        engine.submit(job)
        engine.submit(after)
        return await collect(job), job, await collect(after)

    (text, done), job, (after_text, _) = asyncio.run(main())
    assert ids(text) == ref[:k] and done[1].finish_reason == "stop"
    assert job.result.tokens == ref[:k + 1]  # the driver stopped right after the stop string's token
    assert done[1].completion_tokens == k + 1
    assert ids(after_text) == refs[2]


def test_cancel_ends_the_request_at_the_next_token(setup):
    engine, prompts, refs = setup

    async def main():
        loop = asyncio.get_running_loop()
        job, after = Job(request(prompts[0]), None, loop), Job(request(prompts[1]), None, loop)
        engine.submit(job)
        engine.submit(after)
        cancelled = asyncio.ensure_future(collect(job, cancel_after=3, engine=engine))
        return await cancelled, job, await collect(after)

    (_, done), job, (after_text, _) = asyncio.run(main())
    assert done[1].finish_reason == "cancelled" and job.finish_reason == "cancelled"
    # cancelled from the event loop while the engine thread runs on: it ends within a few tokens
    assert 3 <= len(job.result.tokens) < NEW and job.result.tokens == refs[0][:len(job.result.tokens)]
    assert ids(after_text) == refs[1]


def test_a_queued_request_cancelled_before_its_turn_never_runs(setup):
    engine, prompts, refs = setup

    async def main():
        loop = asyncio.get_running_loop()
        first, second = Job(request(prompts[2]), None, loop), Job(request(prompts[0]), None, loop)
        engine.submit(first)
        engine.submit(second)
        engine.cancel(second)
        return await collect(first), second

    (text, _), second = asyncio.run(main())
    assert ids(text) == refs[2]
    assert second.started is None and second.result is None and second.finish_reason == "cancelled"


def test_max_batch_runs_requests_together_and_each_stays_lossless(setup):
    """--max-batch 2: a queued request joins when a slot is free, so requests overlap in the
    pipeline; each reply is its solo greedy one; a cancelled one ends at its next token while the
    others run on, a request the engine refuses gets its 400, and a call still waits its turn."""
    _, prompts, refs = setup
    ecfg = tiny_engine_config("llama", 3)
    engine = EngineLoop(lambda: ReferenceExecutor(ecfg), queue_limit=4, eos_ids=(), max_batch=2)
    engine.start(timeout=60)
    try:
        async def main():
            loop = asyncio.get_running_loop()
            jobs = [Job(request(p), None, loop) for p in prompts + prompts[:1]]
            too_long = Job(ServeRequest(list(prompts[0]), ecfg.runtime.capacity, SamplingParams(), (),
                                        ParsedRequest(chat=False, model="m", prompt=prompts[0])), None, loop)
            for job in jobs[:2] + [too_long] + jobs[2:]:
                engine.submit(job)
            cancelled = asyncio.ensure_future(collect(jobs[3], cancel_after=3, engine=engine))
            outs = [await collect(job) for job in jobs[:3]]
            return outs, await cancelled, jobs, await collect(too_long), engine.call(lambda rt: "called")

        outs, (_, done), jobs, (_, refused), called = asyncio.run(main())
        for (text, _), job, ref in zip(outs, jobs, refs):
            assert ids(text) == ref == job.result.tokens
        assert jobs[1].started < jobs[0].token_times[-1]  # the second ran beside the first
        assert done[1].finish_reason == "cancelled" and 3 <= len(jobs[3].result.tokens) < NEW
        assert jobs[3].result.tokens == refs[0][:len(jobs[3].result.tokens)]
        assert refused[0] == "error" and refused[1].status == 400 and "capacity" in refused[1].message
        assert called == "called" and engine.running() == 0
        counts = engine.stage_counts()  # what /metrics reports: several requests shared stage steps
        assert counts.ticks > 0 and sum(counts.rows) > sum(counts.steps) and 0 < sum(counts.useful) <= 3 * counts.ticks
        text = ServeMetrics(3, lambda: 0, lambda: 0, stage_counts=engine.stage_counts).exposition().decode()
        per_stage = [float(re.search(rf'spd:stage_utilization_by_stage{{stage="{s}"}} (\S+)', text)[1]) for s in range(3)]
        assert per_stage == [u / counts.ticks for u in counts.useful] and all(0 < u <= 1 for u in per_stage)
        overall = float(re.search(r"^spd:stage_utilization (\S+)", text, re.M)[1])
        assert overall == pytest.approx(sum(per_stage) / 3)
        assert float(re.search(r"^spd:rows_per_stage_step (\S+)", text, re.M)[1]) > 1  # requests shared steps
    finally:
        assert engine.stop(timeout=30)


def test_a_critical_request_beside_batch_ones_goes_first_and_equals_itself_alone(setup):
    """--max-batch 2: while the engine is busy with a batch request, a batch request, a critical one
    and a batch one of higher priority queue in that order; the critical one takes the free slot
    first, then the higher priority one, and every reply (the critical one's beside the others
    in the pipeline) is its solo greedy one."""
    _, prompts, refs = setup
    ecfg = tiny_engine_config("llama", 3)
    engine = EngineLoop(lambda: ReferenceExecutor(ecfg), queue_limit=4, eos_ids=(), max_batch=2)
    engine.start(timeout=60)
    gate, busy = threading.Event(), threading.Event()
    try:
        async def main():
            loop = asyncio.get_running_loop()
            first = Job(request(prompts[0]), None, loop)
            on_token = first.on_token

            def held(token: int) -> bool:  # the engine thread waits here at first's first token
                busy.set()
                assert gate.wait(30)
                return on_token(token)

            first.on_token = held
            engine.submit(first)
            assert await loop.run_in_executor(None, busy.wait, 30)
            later = [Job(request(prompts[1]), None, loop), Job(request(prompts[2], latency="critical"), None, loop),
                     Job(request(prompts[0], priority=5), None, loop)]
            for job in later:
                engine.submit(job)
            gate.set()
            return [await collect(job) for job in [first, *later]], [first, *later]

        outs, jobs = asyncio.run(main())
        for (text, done), job, ref in zip(outs, jobs, [refs[0], refs[1], refs[2], refs[0]]):
            assert ids(text) == ref == job.result.tokens and done[1].finish_reason == "length"
        first, plain, critical, high = jobs
        assert critical.started < high.started < plain.started
        assert critical.token_times[0] < first.token_times[-1]  # it ran beside the first request
    finally:
        gate.set()
        assert engine.stop(timeout=30)

"""Admission of `spd serve` on the engine thread with a scripted runtime (in-process, no ranks):
`--max-queue` counts the requests a client can still see unfinished, so a request that arrives
after the previous one's last event is admitted even when the engine has not yet taken the next
job (the 429 race of serve_load), and `--max-queue 0` admits one request at a time."""
from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from types import SimpleNamespace

import pytest

from spd_engine.engine.protocol.sampling import SamplingParams
from spd_engine.server.engine_loop import EngineLoop
from spd_engine.server.job import SPD_FIELDS, Job
from spd_engine.server.openai_api import ApiError, ParsedRequest
from spd_engine.server.request import ServeRequest


class ScriptedRuntime:
    """generate() commits two tokens, then waits until the test lets the request end."""

    def __init__(self) -> None:
        self.release = threading.Semaphore(0)

    def generate(self, prompt_ids, max_tokens, eos, on_token=None, sampling=None):
        for t in (7, 8):
            on_token(t)
        self.release.acquire()
        return SimpleNamespace(tokens=[7, 8], **dict.fromkeys(SPD_FIELDS, 0))


class SlowMetrics:
    """The engine's bookkeeping after a request (metrics) takes a while: the window in which the
    engine has answered a request but not yet taken the next job."""

    def request_done(self, job, res) -> None:
        time.sleep(1.0)

    def outcome(self, outcome: str) -> None:
        pass


def job(loop) -> Job:
    parsed = ParsedRequest(chat=False, model="m", prompt=[1, 2])
    return Job(ServeRequest([1, 2], 2, SamplingParams(), (), parsed), None, loop)


async def last_event(j: Job) -> tuple:
    while (event := await j.events.get())[0] == "piece":
        pass
    return event


@pytest.fixture
def engine_of():
    engines = []

    def make(max_queue: int) -> tuple[EngineLoop, ScriptedRuntime]:
        runtime = ScriptedRuntime()
        engine = EngineLoop(lambda: contextlib.nullcontext(runtime), max_queue, eos_ids=(), metrics=SlowMetrics())
        engine.start(timeout=10)
        engines.append((engine, runtime))
        return engine, runtime

    yield make
    for engine, runtime in engines:
        for _ in range(8):
            runtime.release.release()
        assert engine.stop(timeout=30)


def test_a_request_after_the_previous_ones_last_event_is_admitted(engine_of):
    engine, runtime = engine_of(1)

    async def main():
        loop = asyncio.get_running_loop()
        a, b = job(loop), job(loop)
        engine.submit(a)
        engine.submit(b)  # waits behind a: the queue holds its limit
        with pytest.raises(ApiError) as info:  # a third is one too many
            engine.submit(job(loop))
        assert info.value.status == 429 and info.value.headers == {"Retry-After": "1"}
        runtime.release.release()
        assert (await last_event(a))[0] == "done"
        # a's client has its answer; the engine is still busy with a's bookkeeping and has not taken b
        assert engine.waiting() == 1
        engine.submit(job(loop))  # before the fix: 429 "1 requests waiting (limit 1)"

    asyncio.run(main())


def test_max_queue_0_admits_one_request_at_a_time(engine_of):
    engine, runtime = engine_of(0)

    async def main():
        loop = asyncio.get_running_loop()
        for _ in range(3):
            a = job(loop)
            engine.submit(a)  # before the fix: 429 "0 requests waiting (limit 0)" on an idle server
            with pytest.raises(ApiError) as info:
                engine.submit(job(loop))
            assert info.value.status == 429
            runtime.release.release()
            assert (await last_event(a))[0] == "done"

    asyncio.run(main())

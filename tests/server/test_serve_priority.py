"""The latency class and priority of `spd serve` requests (docs/serve.md, docs/design.md 3.12), in
one process on a scripted runtime: the HTTP fields reach the runtime's BatchRequest, bad values
are 400s naming the field, /metrics counts admissions per class, and the jobs waiting behind a busy
engine are taken critical first, then by higher priority, then in arrival order, at B = 1 and B = 2."""
from __future__ import annotations

import asyncio
import contextlib
import re
import threading

import pytest
from fastapi.testclient import TestClient

from spd_engine.engine.protocol.metrics import GenerationResult
from spd_engine.engine.protocol.sampling import SamplingParams
from spd_engine.server.app import build_app
from spd_engine.server.engine_loop import EngineLoop
from spd_engine.server.exporter import ServeMetrics, without_model_name
from spd_engine.server.job import Job
from spd_engine.server.openai_api import ParsedRequest
from spd_engine.server.request import ModelInfo, ServeRequest

INFO = ModelInfo(name="m", tok=None, tok_dir=None, vocab_size=100, capacity=32, eos_ids=())


class GatedRuntime:
    """Waits at its first request until the test opens the gate (so requests queue behind a busy
    engine), then commits one token per request. Records the order requests entered by their
    first prompt id, and the BatchRequests handed over (generate_batch takes one at a time)."""

    def __init__(self) -> None:
        self.gate, self.busy = threading.Event(), threading.Event()
        self.order: list[int] = []
        self.requests: list = []

    def _wait(self) -> None:
        self.busy.set()
        assert self.gate.wait(30)

    def generate(self, prompt_ids, max_tokens, eos, on_token=None, sampling=None) -> GenerationResult:
        self.order.append(prompt_ids[0])
        self._wait()
        on_token(7)
        return GenerationResult(tokens=[7], n=2)

    def check_request(self, prompt, max_new_tokens) -> None:
        pass

    def generate_batch(self, requests, max_batch, intake=None, on_done=None, max_rows=None) -> None:
        self._wait()
        index = 0
        while (r := intake()) is not None:
            self.requests.append(r)
            self.order.append(r.prompt[0])
            r.on_token(7)
            on_done(index, GenerationResult(tokens=[7], n=2))
            index += 1


@pytest.fixture
def engine_of():
    engines = []

    def make(max_batch: int) -> tuple[EngineLoop, GatedRuntime]:
        runtime = GatedRuntime()
        engine = EngineLoop(lambda: contextlib.nullcontext(runtime), 8, eos_ids=(), max_batch=max_batch)
        engine.start(timeout=10)
        engines.append((engine, runtime))
        return engine, runtime

    yield make
    for engine, runtime in engines:
        runtime.gate.set()
        assert engine.stop(timeout=30)


def job(first_id: int, loop, latency: str = "batch", priority: int = 0) -> Job:
    parsed = ParsedRequest(chat=False, model="m", prompt=[first_id], latency=latency, priority=priority)
    return Job(ServeRequest([first_id], 1, SamplingParams(), (), parsed), None, loop)


async def last_event(j: Job) -> tuple:
    while (event := await j.events.get())[0] == "piece":
        pass
    return event


@pytest.mark.parametrize("max_batch", [1, 2])
def test_waiting_jobs_go_critical_first_then_by_priority_then_in_arrival_order(engine_of, max_batch):
    engine, runtime = engine_of(max_batch)

    async def main():
        loop = asyncio.get_running_loop()
        first = job(1, loop, "batch", -5)
        engine.submit(first)
        assert await loop.run_in_executor(None, runtime.busy.wait, 10)  # the engine holds `first`
        waiting = [job(10, loop), job(11, loop, priority=2), job(12, loop, "critical"), job(13, loop),
                   job(14, loop, priority=2), job(15, loop, "critical", 3), job(16, loop, priority=-1),
                   job(17, loop, priority=2)]
        for j in waiting:
            engine.submit(j)
        engine.cancel(waiting[-1])  # a cancelled job leaves its place; the others keep theirs
        assert engine.waiting() == len(waiting) - 1
        runtime.gate.set()
        return [await last_event(j) for j in [first, *waiting[:-1]]]

    events = asyncio.run(main())
    assert all(e[0] == "done" for e in events), events
    assert runtime.order == [1, 15, 12, 11, 14, 10, 13, 16]
    if max_batch > 1:  # the BatchRequests carry the class and priority to the driver's row policy
        assert [(r.latency, r.priority) for r in runtime.requests[:3]] == [("batch", -5), ("critical", 3),
                                                                           ("critical", 0)]


def test_http_fields_reach_the_batch_request_and_bad_values_are_400s(engine_of):
    engine, runtime = engine_of(2)
    runtime.gate.set()
    metrics = ServeMetrics(2, engine.waiting, engine.running, INFO.name)
    engine.metrics = metrics
    client = TestClient(build_app(engine, INFO, metrics, 30.0), base_url="http://127.0.0.1")  # an allowed Host
    bodies = [({"model": "m", "prompt": [5], "max_tokens": 1, "latency": "critical", "priority": 4}, "completions"),
              ({"model": "m", "prompt": [6], "max_tokens": 1}, "completions"),
              ({"model": "m", "prompt": [7], "max_tokens": 1, "priority": -2, "stream": True}, "completions")]
    for body, path in bodies:
        r = client.post(f"/v1/{path}", json=body)
        assert r.status_code == 200, r.text
    # the HTTP field orders as vLLM's (lower first); the engine's priority is its negation (higher first)
    assert [(r.latency, r.priority) for r in runtime.requests] == [("critical", -4), ("batch", 0), ("batch", 2)]
    for field, value, says in [("priority", True, "must be an integer"), ("priority", 2.0, "must be an integer"),
                               ("latency", "realtime", "'batch' (the default) or 'critical'")]:
        for path in ("completions", "chat/completions"):
            body = {"model": "m", "max_tokens": 1, field: value, "prompt": [5]} if path == "completions" else \
                {"model": "m", "max_tokens": 1, field: value, "messages": [{"role": "user", "content": "x"}]}
            r = client.post(f"/v1/{path}", json=body)
            error = r.json()["error"]
            assert r.status_code == 400 and error["param"] == field and says in error["message"], r.text
    text = without_model_name(client.get("/metrics").text)
    admitted = {c: float(re.search(rf'^spd:request_admitted_total{{latency="{c}"}} (\S+)$', text, re.M)[1])
                for c in ("batch", "critical")}
    assert admitted == {"batch": 2.0, "critical": 1.0}
    assert re.search(r'^spd:request_total{outcome="bad_request"} 6.0$', text, re.M)

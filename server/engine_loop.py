"""The engine side of `spd serve`: one thread owns the runtime and runs one request at a time, or
with `--max-batch B` up to B at once in the pipeline (docs/design.md 3.12): a queued request joins
as soon as a slot is free, and leaves at its end.

The engine thread enters the runtime (engine/launch.launch: ranks, KV caches and CUDA graphs stay
up for the life of the server), then takes jobs (server/job.py) from a bounded queue (server/job_queue.py):
latency-critical requests
first, then higher priority, then arrival order (docs/design.md 3.12's order; it decides who takes
a free slot, and which request runs next at B = 1). A job's `on_token`
runs on that thread for every committed token: it detokenizes, cuts at stop strings and hands
pieces to the job's asyncio queue; it returns False to end the request after that token (a stop
string, a client that went away, a deadline), and the driver then drains the pipeline so the next
request starts clean. A stage failure (the driver raises, naming the rank) fails the request in
flight with a 500, fails every queued one with a 503 and marks the engine failed; so does a rank
process that dies while the server is idle (spawned ranks are watched), and a request that commits
no token for the stall deadline (serve_stall: the rank that went silent is named). A failed engine
kills its spawned ranks, so a stopped or hung rank cannot hold the server (or outlive it).

Admission counts what the server holds, not the queue's length: at most `max_queue + B` unfinished
requests (the B in the pipeline plus `max_queue` waiting). A request counts from its admission
until its last event is handed to the event loop, so a client that has its `[DONE]` has freed its
place even if the engine has not taken the next job yet, and `--max-queue 0` serves one at a time.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

from spd_engine.engine.comm.transport import TransportError
from spd_engine.engine.protocol.metrics import GenerationResult
from spd_engine.engine.runtime.batch_driver import BatchRequest
from spd_engine.server.job import DirectCall, Job
from spd_engine.server.job_queue import JobQueue, QueueFull
from spd_engine.server.openai_api import ApiError
from spd_engine.server.stall import StallWatch


class BatchInFlight:
    """The jobs in the pipeline together (--max-batch > 1): what the stall watch and a failure see."""

    def __init__(self) -> None:
        self.jobs: set[Job] = set()
        self.started = time.monotonic()
        self.finish_reason: str | None = None

    @property
    def last_progress(self) -> float:
        """When one of them last moved."""
        return max((j.last_progress for j in self.jobs), default=self.started)


class EngineFailure(RuntimeError):
    pass


def describe_failure(err: BaseException) -> str:
    if isinstance(err, TransportError):
        return f"lost stage rank {err.peer}: {err}"
    return f"the pipeline failed: {err}"


def describe_exit(code: int) -> str:
    return f"killed by signal {-code}" if code < 0 else f"exit code {code}"


class EngineLoop:
    """The engine thread, its queue and its state: starting, ready, draining, stopped or failed."""

    def __init__(self, open_runtime: Callable[[], AbstractContextManager], queue_limit: int, eos_ids,
                 metrics=None, rank_processes: Callable[[], list] | None = None, rank_grace_s: float = 5.0,
                 on_fatal: Callable[[str], None] | None = None, stall_s: float | None = None,
                 max_batch: int = 1, max_rows: int | None = None) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.max_rows = max_rows  # decode rows per stage step (engine/runtime/batch_driver.py); None: B
        self.open_runtime, self.metrics, self.eos = open_runtime, metrics, set(eos_ids)
        self.max_queue, self.max_batch = queue_limit, max_batch
        # the queue may briefly hold max_queue + B jobs: admission (submit) is the limit, see above
        self.queue = JobQueue(queue_limit + max_batch)
        self.rank_processes, self.rank_grace_s = rank_processes, rank_grace_s
        self.on_fatal = on_fatal
        self.stall_s = stall_s
        self.ranks: dict[int, Any] = {}  # {rank: multiprocessing.Process} of spawned ranks (set_ranks)
        self._open = 0  # admitted jobs not yet ended (the one in the pipeline included)
        self.state = "starting"
        self.failure: str | None = None
        self.current: Job | BatchInFlight | DirectCall | None = None
        self.runtime = None  # the engine thread's runtime, once it is up
        self._start_error: BaseException | None = None
        self._ready = threading.Event()
        self._leaving = threading.Event()  # set once the loop is done and the runtime shuts its ranks down
        self._lock = threading.Lock()
        self.thread = threading.Thread(target=self._main, name="spd-engine", daemon=True)

    # ---- control (any thread) ----
    def start(self, timeout: float | None = None) -> None:
        """Start the engine thread and wait until the ranks are up; raises if they did not come up."""
        self.thread.start()
        if not self._ready.wait(timeout):
            raise RuntimeError(f"the ranks did not come up within {timeout} s")
        if self.state != "ready":
            raise self._start_error

    def set_ranks(self, procs: dict[int, Any]) -> None:
        """The spawned stage ranks {rank: multiprocessing.Process} (engine/launch.launch's on_ranks)."""
        self.ranks = dict(procs)

    def open_jobs(self) -> int:
        """Admitted requests not yet ended (waiting or in the pipeline)."""
        return self._open

    def _release(self) -> None:
        with self._lock:
            self._open -= 1

    def submit(self, job: Job) -> None:
        """Queue a job: ApiError 503 when not accepting, 429 when max_queue requests wait behind the
        one in the pipeline (Retry-After on both)."""
        if self.state != "ready":
            reason = self.failure if self.state == "failed" else f"the server is {self.state}"
            code = "draining" if self.state == "draining" else "unavailable"
            raise ApiError(503, f"not accepting requests: {reason}", type="server_error", code=code,
                           headers={"Retry-After": "1"})
        with self._lock:
            if self._open >= self.max_queue + self.max_batch:
                raise ApiError(429, f"the request queue is full: {self._open - self.max_batch} requests waiting (limit "
                                    f"{self.max_queue})", type="rate_limit_error", code="queue_full",
                               headers={"Retry-After": "1"})
            self._open += 1
            job.on_close = self._release
        try:
            self.queue.put(job)
        except QueueFull:  # closed meanwhile (a failure or the end of a drain)
            job.close()
            raise ApiError(503, "not accepting requests: the server is stopping", type="server_error",
                           code="unavailable", headers={"Retry-After": "1"}) from None

    def cancel(self, job: Job, reason: str = "cancelled") -> None:
        """Client gone or deadline passed: drop it from the queue, or end it at its next token."""
        job.ask_cancel(reason)
        if self.queue.remove(job):
            job.finish_reason = reason
            job.close()
            self._count(reason)

    def call(self, fn: Callable[[Any], Any], timeout: float | None = None):
        """Run fn(runtime) on the engine thread, after the requests queued before it; return its value."""
        item = DirectCall(fn)
        self.queue.put(item)
        if not item.done.wait(timeout):
            raise TimeoutError("the engine did not run the call in time")
        if item.error is not None:
            raise item.error
        return item.value

    def drain(self) -> None:
        """Refuse new requests; queued and running ones go on."""
        if self.state == "ready":
            self.state = "draining"

    def abort(self, reason: str) -> int:
        """End every held request now (a drain past its deadline): each gets a 503 (a stream: an error
        event and [DONE]); the one in the pipeline stops at its next token. The number ended."""
        self.drain()
        err = lambda: ApiError(503, reason, type="server_error", code="unavailable")  # noqa: E731
        ended = 0
        for item in self.queue.close(discard=True):
            if isinstance(item, Job) and item.fail(err()):
                ended += 1
                self._count("unavailable")
            elif isinstance(item, DirectCall):
                item.error = EngineFailure(reason)
                item.done.set()
        for job in self.in_flight():
            if job.fail(err()):
                ended += 1
                self._count("unavailable")
        return ended

    def in_flight(self) -> list[Job]:
        """The jobs in the pipeline now."""
        current = self.current
        if isinstance(current, BatchInFlight):
            return list(current.jobs)
        return [current] if isinstance(current, Job) else []

    def running(self) -> int:
        return len(self.in_flight())

    def stage_counts(self):
        """The pipeline's stage counts over every run of several requests (StageCounts), or None."""
        batch = getattr(self.runtime, "batch", None)  # pp / ar runtimes have none
        return None if batch is None else batch.lifetime

    def stop(self, timeout: float | None = None) -> bool:
        """After the queued requests: leave the runtime (ranks shut down). True if the thread ended."""
        self.drain()
        self.queue.close()
        self.thread.join(timeout)
        return not self.thread.is_alive()

    def waiting(self) -> int:
        return len(self.queue)

    # ---- the engine thread ----
    def _main(self) -> None:
        try:
            with self.open_runtime() as runtime:
                self.runtime = runtime
                self.state = "ready"
                self._ready.set()
                self._watch_ranks()
                while (item := self.queue.get()) is not None:
                    if self.max_batch > 1 and isinstance(item, Job):
                        self._run_batch(runtime, item)
                        continue
                    self.current = item
                    self._run(runtime, item)
                    self.current = None
                self._leaving.set()  # the ranks shut down next, with exit code 0: not a death
                if self.failure is not None:
                    raise EngineFailure(self.failure)  # leave the runtime through its error path
        except BaseException as err:  # noqa: B036 - the engine thread must record every way it ends
            self._start_error = err
            self._fail(describe_failure(err) if self.failure is None else self.failure)
        finally:
            if self.state not in ("failed",):
                self.state = "stopped"
            self._ready.set()

    def _run(self, runtime, item: Job | DirectCall) -> None:
        if isinstance(item, DirectCall):
            try:
                item.value = item.fn(runtime)
            except BaseException as err:  # noqa: B036 - handed back to the caller
                item.error = err
                raise
            finally:
                item.done.set()
            return
        job = item
        if job.cancel_reason is not None:  # gone before its turn
            if job.close():
                job.finish_reason = job.cancel_reason
                self._count(job.cancel_reason)
            return
        job.started = time.monotonic()
        req = job.req
        eos = set() if req.parsed.ignore_eos else self.eos
        asked = {} if req.parsed.logprobs is None else {"top_logprobs": req.parsed.logprobs}
        if asked and not getattr(runtime, "gives_logprobs", False):
            job.fail(ApiError(400, "logprobs: this server's mode does not give log-probabilities (SPD does)",
                              param="logprobs"))
            self._count("bad_request")
            return
        try:  # with log-probabilities asked the driver calls on_token(token, scored)
            res = runtime.generate(req.prompt_ids, req.max_tokens, tuple(eos), on_token=job.on_token,
                                   sampling=req.sampling, **asked)
        except ValueError as err:  # refused before any work: the pipeline is untouched
            job.fail(ApiError(400, str(err)))
            self._count("bad_request")
            return
        except (TransportError, RuntimeError, AssertionError) as err:
            self._fail(describe_failure(err))
            raise
        job.finish(res, eos)
        if self.metrics is not None:
            self.metrics.request_done(job, res)

    def _start(self, job: Job, gives_logprobs: bool) -> BatchRequest | None:
        """A job about to enter the pipeline as a BatchRequest; None when it ended first (cancelled
        while queued, or refused: a 400; `gives_logprobs`: whether the runtime records them)."""
        if job.cancel_reason is not None:  # gone before its turn
            if job.close():
                job.finish_reason = job.cancel_reason
                self._count(job.cancel_reason)
            return None
        req = job.req
        if req.parsed.logprobs is not None and not gives_logprobs:
            if job.fail(ApiError(400, "logprobs: this server's mode does not give log-probabilities (SPD does)",
                                 param="logprobs")):
                self._count("bad_request")
            return None
        eos = set() if req.parsed.ignore_eos else self.eos
        job.eos = eos
        logprobs = -1 if req.parsed.logprobs is None else req.parsed.logprobs
        return BatchRequest(req.prompt_ids, req.max_tokens, tuple(eos), req.sampling, on_token=job.on_token,
                            latency=req.latency, priority=req.priority, top_logprobs=logprobs)

    def _run_batch(self, runtime, first: Job) -> None:
        """Jobs in the pipeline B at a time, from `first` on, while the queue has jobs (a DirectCall
        waits for the pipeline to empty): each joins when a slot is free."""
        batch = BatchInFlight()
        jobs: list[Job] = []
        pending = [first]

        def intake() -> BatchRequest | None:
            while pending or (nxt := self.queue.get_nowait(Job)) is not None:
                job = pending.pop() if pending else nxt
                request = self._start(job, getattr(runtime, "gives_logprobs", False))
                if request is None:
                    continue
                batch.jobs.add(job)  # from here on a failure of the engine fails it too
                try:
                    runtime.check_request(request.prompt, request.max_new_tokens)
                except ValueError as err:  # refused before any work
                    batch.jobs.discard(job)
                    job.fail(ApiError(400, str(err)))
                    self._count("bad_request")
                    continue
                job.started = time.monotonic()
                jobs.append(job)
                return request
            return None

        def on_done(index: int, res: GenerationResult) -> None:
            job = jobs[index]
            batch.jobs.discard(job)
            job.finish(res, job.eos)
            if self.metrics is not None:
                self.metrics.request_done(job, res)

        self.current = batch
        try:
            out = runtime.generate_batch([], self.max_batch, intake=intake, on_done=on_done, max_rows=self.max_rows)
            if self.metrics is not None and out is not None:
                self.metrics.stages_done(out.stages)
        except (TransportError, RuntimeError, AssertionError) as err:
            self._fail(describe_failure(err))
            raise
        finally:
            self.current = None

    def _count(self, outcome: str) -> None:
        if self.metrics is not None:
            self.metrics.outcome(outcome)

    def _fail(self, reason: str, code: str = "rank_failed") -> None:
        """Mark the engine failed (once): the request in flight gets a 500, queued ones a 503, and the
        spawned ranks are killed (a stopped or hung one would otherwise hold the driver and outlive us)."""
        with self._lock:
            if self.state == "failed":
                return
            self.failure, self.state = reason, "failed"
        for job in self.in_flight():
            if job.fail(ApiError(500, reason, type="server_error", code=code)):
                self._count("error")
        for item in self.queue.close(discard=True):
            if isinstance(item, Job) and item.fail(ApiError(503, f"not served: {reason}", type="server_error",
                                                            code="unavailable")):
                self._count("error")
            elif isinstance(item, DirectCall):
                item.error = EngineFailure(reason)
                item.done.set()
        if self.on_fatal is not None:
            self.on_fatal(reason)
        self.kill_ranks()

    def kill_ranks(self) -> None:
        """SIGKILL the spawned stage ranks still running (after a failure: nothing of them is needed)."""
        if self.ranks:
            from spd_engine.engine.runtime.launch import kill_ranks

            kill_ranks(list(self.ranks.values()))

    def _watch_ranks(self) -> None:
        """Watch spawned rank processes (one that dies fails the engine even while no request runs)
        and, with a stall deadline, the request in the pipeline."""
        procs = self.rank_processes() if self.rank_processes is not None else []
        if procs or self.stall_s is not None:
            threading.Thread(target=self._watch, args=(procs,), name="spd-rank-watch", daemon=True).start()

    def _stalled(self, stall: StallWatch | None, running: Job | BatchInFlight | None) -> bool:
        """Fail the engine if the job in the pipeline is stalled (True then)."""
        if stall is None or running is None or running.started is None or running.finish_reason is not None:
            return False
        reason = stall.check(running.last_progress)
        if reason is None:
            return False
        self._fail(f"stalled: {reason}", code="rank_stalled")
        return True

    def _watch(self, procs: list) -> None:
        stall = StallWatch(self.stall_s, {r: p.pid for r, p in self.ranks.items()},
                           self.metrics.cpu_waits.inc if self.metrics is not None else None) \
            if self.stall_s is not None else None
        last_job = None
        while self.state in ("ready", "draining") and not self._leaving.is_set():
            current = self.current if isinstance(self.current, (Job, BatchInFlight)) else None
            if current is not last_job and stall is not None:
                stall.reset()
                last_job = current
            if self._stalled(stall, current):
                return
            dead = [p for p in procs if p.exitcode is not None]
            if not dead:
                time.sleep(0.25)
                continue
            what = ", ".join(f"rank process pid {p.pid} ({describe_exit(p.exitcode)})" for p in dead)
            busy = self.current
            if busy is not None:  # the driver's own error names the rank it lost: give it a moment
                deadline = time.monotonic() + self.rank_grace_s
                while self.current is busy and self.state != "failed" and time.monotonic() < deadline:
                    time.sleep(0.1)
            if self.state in ("ready", "draining") and not self._leaving.is_set():
                self._fail(f"a stage rank died: {what}")
            return

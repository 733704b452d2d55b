"""The HTTP side of `spd serve` (FastAPI): OpenAI endpoints, /health and /metrics.

A request is validated and made ready (serve_request) before it queues, so a refusal costs the
pipeline nothing. The handler then waits for the job's first event before answering, so an error
before the first token (deadline in the queue, a failed rank) still gets its HTTP status; a
stream then sends one server-sent event per text piece and ends with `data: [DONE]`. While a
request waits, the client going away cancels it (removed from the queue, or ended by the engine
at its next token); during a stream Starlette notices the disconnect and cancels the generator,
whose `finally` does the same. Every wait is bounded by the request's deadline. A request for
`n` choices queues them as n requests (server/request.choices) at once, so a batching pipeline
runs them together; the reply gathers them in choice order (a stream sends each choice's
chunks in turn, each naming its `index`).

Before any of that, http_guards checks the API key (or, without one, the Host header), the
content type and the body's size (413 before parsing), and prompts are tokenized by
tokenizing's worker process, never on the event loop. A client that leaves before its body has
arrived is counted as cancelled (499 in the log), one whose body missed the body deadline as a
timeout (the connection answered it 408: server/connections.py). Every answer
carries the request's X-Request-Id; every request ends with one log line (serve_logging); an
error nobody foresaw is still a 500 in OpenAI's shape, counted and logged on one line.
"""
from __future__ import annotations

import asyncio
import logging
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from spd_engine.server.engine_loop import EngineLoop
from spd_engine.server.exporter import CONTENT_TYPE, ServeMetrics
from spd_engine.server.http_guards import (
    DEFAULT_MAX_REQUEST_BYTES,
    ClientAddress,
    check_api_key,
    check_host,
    check_json_type,
    parse_json,
    read_body,
    request_id,
)
from spd_engine.server.job import Job
from spd_engine.server.openai_api import ApiError, bad, parse_request
from spd_engine.server.request import ModelInfo, check_model, choices, prepare
from spd_engine.server.request_log import request_line
from spd_engine.server.responses import DONE, ReplyBuilder, Summary, sse
from spd_engine.server.tokenize_api import detokenize, model_card, model_lookup, server_version, tokenize
from spd_engine.server.tokenizing import PromptEncoder

LOG = logging.getLogger("spd.serve")


class ClientGone(Exception):
    pass


async def _disconnected(request: Request) -> None:
    """Returns when the client closes the connection (after the body has been read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class Waiter:
    """Next event of a job, bounded by its deadline; optionally also watching for a disconnect."""

    def __init__(self, engine: EngineLoop, job: Job, request: Request | None, timeout_s: float) -> None:
        """request None: no disconnect watch (a stream's, which Starlette watches)."""
        self.engine, self.job, self.timeout_s = engine, job, timeout_s
        self.deadline = job.arrival + timeout_s
        self.gone: asyncio.Task | None = None if request is None else asyncio.ensure_future(_disconnected(request))

    def stop_watching(self) -> None:
        """Hand disconnect detection over (to the streaming response)."""
        if self.gone is not None:
            self.gone.cancel()
            self.gone = None

    async def next(self) -> tuple:
        get = asyncio.ensure_future(self.job.events.get())
        waits = {get} if self.gone is None else {get, self.gone}
        done, _ = await asyncio.wait(waits, timeout=max(0.0, self.deadline - time.monotonic()),
                                     return_when=asyncio.FIRST_COMPLETED)
        if get in done:
            event = get.result()
            if event[0] == "error":
                raise event[1]
            return event
        get.cancel()
        if self.gone is not None and self.gone in done:
            self.engine.cancel(self.job, "cancelled")
            raise ClientGone()
        self.engine.cancel(self.job, "timeout")
        raise ApiError(504, f"the request deadline of {self.timeout_s:g} s passed", type="timeout",
                       code="deadline_exceeded")


class RequestLog:
    """What the log line of one request says; written once, when the request is over."""

    def __init__(self, rid: str, path: str) -> None:
        self.rid, self.path, self.t0 = rid, path, time.monotonic()
        self.job: Job | None = None
        self.written = False

    def write(self, status: int, summary: Summary | None = None, finish: str | None = None) -> None:
        if self.written:
            return
        self.written = True
        job = self.job
        times = job.token_times if job is not None else []
        prompt = len(job.req.prompt_ids) if job is not None else None
        request_line(self.rid, self.path, status, prompt, len(times) if job is not None else None,
                     times[0] - job.arrival if times else None, time.monotonic() - self.t0,
                     finish or (summary.finish_reason if summary is not None else None))


def build_app(engine: EngineLoop, info: ModelInfo, metrics: ServeMetrics, request_timeout_s: float,
              encoder: PromptEncoder | None = None, api_key: str | None = None,
              max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
              allowed_hosts: frozenset[str] = frozenset()) -> FastAPI:
    app = FastAPI(title="spd serve", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(ClientAddress)  # the address that bounds a client's share of the tokenizer
    created = int(time.time())

    @app.exception_handler(ApiError)
    async def api_error(request: Request, err: ApiError) -> JSONResponse:
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, err: HTTPException) -> JSONResponse:
        return JSONResponse(ApiError(err.status_code, str(err.detail)).body(), status_code=err.status_code)

    @app.get("/health")
    async def health() -> JSONResponse:
        if engine.state == "ready":
            if encoder is not None:
                encoder.revive()  # a tokenizer process that died is replaced now, not at the next request
            return JSONResponse({"status": "ok", **({"tokenizer_restarts": encoder.restarts}
                                                    if encoder is not None and encoder.restarts else {})})
        return JSONResponse({"status": engine.state, "reason": engine.failure}, status_code=503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.exposition(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models(request: Request) -> dict:
        check_host(request, api_key, allowed_hosts)
        check_api_key(request, api_key)
        return {"object": "list", "data": [model_card(info, created)]}

    @app.get("/v1/models/{model_id:path}")
    async def model(request: Request, model_id: str) -> dict:
        check_host(request, api_key, allowed_hosts)
        check_api_key(request, api_key)
        return model_lookup(model_id, info, created)

    @app.get("/version")
    async def version() -> dict:
        return server_version()

    async def _json_body(request: Request):
        check_host(request, api_key, allowed_hosts)
        check_api_key(request, api_key)
        check_json_type(request)
        return parse_json(await read_body(request, max_request_bytes))

    @app.post("/tokenize")
    async def tokenize_route(request: Request) -> Response:
        try:
            return JSONResponse(await tokenize(await _json_body(request), info, encoder))
        except ClientDisconnect:
            return Response(status_code=499)  # nobody reads it

    @app.post("/detokenize")
    async def detokenize_route(request: Request) -> Response:
        try:
            return JSONResponse(detokenize(await _json_body(request), info))
        except ClientDisconnect:
            return Response(status_code=499)  # nobody reads it

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _serve(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _serve(request, chat=True)

    async def _serve(request: Request, chat: bool) -> Response:
        log = RequestLog(request_id(request), request.url.path)
        headers = {"X-Request-Id": log.rid}
        try:
            return await _handle(request, chat, log, headers)
        except ApiError as err:
            log.write(err.status, finish=err.code or err.type)
            return JSONResponse(err.body(), status_code=err.status, headers={**err.headers, **headers})
        except ClientDisconnect:  # left before its body arrived, or its body missed the deadline
            timed_out = request.scope.get("spd.timed_out") is not None
            metrics.outcome("timeout" if timed_out else "cancelled")
            log.write(408 if timed_out else 499, finish="body_timeout" if timed_out else "cancelled")
            return Response(status_code=499)  # nobody reads it (the connection answered a timeout itself)
        except Exception as err:  # noqa: BLE001 - a bug must still answer in OpenAI's shape, counted and logged
            LOG.error("request %s: unexpected error", log.rid, exc_info=err)
            metrics.outcome("error")
            log.write(500, finish="error")
            body = ApiError(500, f"internal error ({type(err).__name__})", type="server_error").body()
            return JSONResponse(body, status_code=500, headers=headers)

    async def _handle(request: Request, chat: bool, log: RequestLog, headers: dict) -> Response:
        try:
            check_host(request, api_key, allowed_hosts)
            check_api_key(request, api_key)
            check_json_type(request)
            parsed = parse_request(parse_json(await read_body(request, max_request_bytes)), chat)
            check_model(parsed, info)
            ids = await encoder.ids(parsed) if encoder is not None else None  # off the event loop
            reqs = choices(prepare(parsed, info, ids), info)
            held = engine.max_queue + engine.max_batch
            if len(reqs) > held:
                raise bad("n", f"this server holds at most {held} requests at once (--max-queue + --max-batch), "
                               f"got n = {len(reqs)}")
        except ApiError:
            metrics.outcome("bad_request")
            raise
        loop = asyncio.get_running_loop()
        jobs = [Job(req, info.tok, loop, index) for index, req in enumerate(reqs)]
        for job in jobs:
            job.request_id = log.rid
        try:
            for job in jobs:
                engine.submit(job)
                metrics.admitted(job.req.latency)
        except ApiError as err:
            metrics.outcome("queue_full" if err.status == 429 else "unavailable")
            for job in jobs:
                engine.cancel(job)  # the choices admitted before are not served alone
            raise
        log.job = jobs[0]
        waiter = Waiter(engine, jobs[0], request, request_timeout_s)
        streaming = False
        try:
            first = await waiter.next()
            reply = ReplyBuilder(chat, info.name, info.tok)
            if parsed.stream:
                waiter.stop_watching()
                streaming = True
                return StreamingResponse(_events(jobs, waiter, reply, first, parsed.include_usage, log),
                                         media_type="text/event-stream",
                                         headers={"Cache-Control": "no-cache", **headers})
            outcomes = []
            for job in jobs:
                if job is not jobs[0]:  # one disconnect watch at a time
                    waiter.stop_watching()
                    waiter = Waiter(engine, job, request, request_timeout_s)
                    first = await waiter.next()
                pieces, event = [], first
                while event[0] == "piece":
                    pieces.append(event[1])
                    event = await waiter.next()
                outcomes.append(("".join(pieces), event[1]))
            log.write(200, outcomes[0][1])
            return JSONResponse(reply.full(outcomes), headers=headers)
        except ClientGone:
            log.write(499, finish="cancelled")
            return Response(status_code=499)  # nobody reads it
        finally:
            if not streaming:
                waiter.stop_watching()
                for job in jobs:
                    engine.cancel(job)  # no-op for a finished job

    async def _events(jobs: list[Job], waiter: Waiter, reply: ReplyBuilder, first: tuple, include_usage: bool,
                      log: RequestLog):
        """The stream of a reply: its choices one after the other (each chunk names its `index`)."""
        status, summaries, finish = 200, [], "cancelled"  # unless it ends otherwise: the client went away
        try:
            for job in jobs:
                if job is not jobs[0]:
                    waiter = Waiter(engine, job, None, request_timeout_s)
                    first = await waiter.next()
                if reply.chat:
                    yield reply.chunk(None, first=True, index=job.index)
                event = first
                while event[0] == "piece":
                    yield reply.chunk(event[1], index=job.index, logprobs=event[2])
                    event = await waiter.next()
                summaries.append(event[1])
                yield reply.chunk(None, event[1].finish_reason, index=job.index)
            if include_usage:
                yield reply.usage_chunk(summaries)
        except ApiError as err:  # the pipeline failed or the deadline passed mid-stream
            status, finish = err.status, err.code or err.type
            yield sse(err.body())
        finally:
            for job in jobs:
                engine.cancel(job)  # the client went away (Starlette cancels us), or a no-op
            done = len(summaries) == len(jobs)
            log.write(status, summaries[0] if done else None, None if done else finish)
        yield DONE

    return app

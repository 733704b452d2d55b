"""The HTTP side of `spd serve` (FastAPI): OpenAI endpoints, /health and /metrics.

A request is validated and made ready (serve_request) before it queues, so a refusal costs the
pipeline nothing. The handler then waits for the job's first event before answering, so an error
before the first token (deadline in the queue, a failed rank) still gets its HTTP status; a
stream then sends one server-sent event per text piece and ends with `data: [DONE]`. While a
request waits, the client going away cancels it (removed from the queue, or ended by the engine
at its next token); during a stream Starlette notices the disconnect and cancels the generator,
whose `finally` does the same. Every wait is bounded by the request's deadline.
"""
from __future__ import annotations

import asyncio
import json
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from spd_engine.server.engine_loop import EngineLoop, Job
from spd_engine.server.exporter import CONTENT_TYPE, ServeMetrics
from spd_engine.server.openai_api import ApiError, parse_request
from spd_engine.server.request import ModelInfo, prepare
from spd_engine.server.responses import DONE, ReplyBuilder, sse


class ClientGone(Exception):
    pass


async def _disconnected(request: Request) -> None:
    """Returns when the client closes the connection (after the body has been read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class Waiter:
    """Next event of a job, bounded by its deadline; optionally also watching for a disconnect."""

    def __init__(self, engine: EngineLoop, job: Job, request: Request, timeout_s: float) -> None:
        self.engine, self.job, self.timeout_s = engine, job, timeout_s
        self.deadline = job.arrival + timeout_s
        self.gone: asyncio.Task | None = asyncio.ensure_future(_disconnected(request))

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


def build_app(engine: EngineLoop, info: ModelInfo, metrics: ServeMetrics, request_timeout_s: float) -> FastAPI:
    app = FastAPI(title="spd serve", docs_url=None, redoc_url=None, openapi_url=None)
    created = int(time.time())

    @app.exception_handler(ApiError)
    async def api_error(request: Request, err: ApiError) -> JSONResponse:
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, err: HTTPException) -> JSONResponse:
        return JSONResponse(ApiError(err.status_code, str(err.detail)).body(), status_code=err.status_code)

    @app.get("/health")
    async def health() -> JSONResponse:
        if engine.state == "ready":
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": engine.state, "reason": engine.failure}, status_code=503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.exposition(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": info.name, "object": "model", "created": created,
                                            "owned_by": "spd-engine", "max_model_len": info.capacity}]}

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _serve(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _serve(request, chat=True)

    async def _serve(request: Request, chat: bool) -> Response:
        try:
            try:
                body = json.loads(await request.body())
            except ValueError as err:  # not JSON, or not UTF-8
                raise ApiError(400, f"the request body is not valid JSON: {err}") from None
            req = prepare(parse_request(body, chat), info)
        except ApiError:
            metrics.outcome("bad_request")
            raise
        job = Job(req, info.tok, asyncio.get_running_loop())
        try:
            engine.submit(job)
        except ApiError as err:
            metrics.outcome("queue_full" if err.status == 429 else "unavailable")
            raise
        waiter = Waiter(engine, job, request, request_timeout_s)
        streaming = False
        try:
            first = await waiter.next()
            reply = ReplyBuilder(chat, info.name)
            if req.parsed.stream:
                waiter.stop_watching()
                streaming = True
                return StreamingResponse(_events(waiter, reply, first, req.parsed.include_usage),
                                         media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
            pieces, event = [], first
            while event[0] == "piece":
                pieces.append(event[1])
                event = await waiter.next()
            return JSONResponse(reply.full("".join(pieces), event[1]))
        except ClientGone:
            return Response(status_code=499)  # nobody reads it
        finally:
            if not streaming:
                waiter.stop_watching()
                engine.cancel(job)  # no-op for a finished job

    async def _events(waiter: Waiter, reply: ReplyBuilder, first: tuple, include_usage: bool):
        try:
            if reply.chat:
                yield reply.chunk(None, first=True)
            event = first
            while event[0] == "piece":
                yield reply.chunk(event[1])
                event = await waiter.next()
            summary = event[1]
            yield reply.chunk(None, summary.finish_reason)
            if include_usage:
                yield reply.usage_chunk(summary)
        except ApiError as err:  # the pipeline failed or the deadline passed mid-stream
            yield sse(err.body())
        finally:
            engine.cancel(waiter.job)  # the client went away (Starlette cancels us), or a no-op
        yield DONE

    return app

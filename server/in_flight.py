"""The cap on requests in flight in `spd serve`: an ASGI wrapper around the application.

A request is in flight from its complete head to the end of its answer (reading its body,
tokenizing, queued, streaming). Past `--max-in-flight` a new one is answered at once with a 503
in OpenAI's shape and `Retry-After: 1`, before its body is read: the bodies held at once, and so
the memory they take, stay bounded by the cap times `--max-request-bytes`. Refusals are logged
once per interval with a count. Probes (`GET /health`, `GET /metrics`: no body, answered at once)
are neither counted nor refused, so a server at its cap is not restarted by its liveness probe.
"""
from __future__ import annotations

import json
from collections.abc import Callable

from spd_engine.server.request_log import Throttled

PROBES = ("/health", "/metrics")


class InFlightCap:
    """`app` with at most `limit` HTTP requests in flight; `on_refused(path)` counts a refusal."""

    def __init__(self, app, limit: int, on_refused: Callable[[str], None] | None = None) -> None:
        self.app, self.limit, self.on_refused = app, limit, on_refused
        self.in_flight = 0
        self.log = Throttled()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or (scope.get("method") == "GET" and scope.get("path") in PROBES):
            await self.app(scope, receive, send)
            return
        if self.in_flight >= self.limit:
            await self._refuse(scope, send)
            return
        self.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1

    async def _refuse(self, scope, send) -> None:
        self.log.event("in_flight", "refused %d request(s) with 503: %d requests in flight (--max-in-flight)",
                       self.limit)
        if self.on_refused is not None:
            self.on_refused(scope.get("path", ""))
        body = json.dumps({"error": {"message": f"the server holds {self.limit} requests (--max-in-flight); retry "
                                                "shortly", "type": "server_error", "param": None,
                                     "code": "too_many_requests"}}).encode()
        await send({"type": "http.response.start", "status": 503,
                    "headers": [(b"content-type", b"application/json"), (b"retry-after", b"1"),
                                (b"content-length", str(len(body)).encode()), (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})

"""The connections of `spd serve`: read deadlines, a cap on open connections, lingering closes.

uvicorn's HTTP/1.1 protocol (h11) holds a connection for as long as its client keeps it open,
however little it sends. GuardedH11Protocol adds what production front ends set:

- a header deadline: a connection that has not sent a complete request head within
  `header_s` of its opening (or of its last answer, kept alive) is closed;
- a body deadline: a request whose body has not fully arrived `body_s` after its head gets a
  408 (if nothing was answered yet) and the connection is closed; the handler sees a client
  that went away, and the request's scope says why (`spd.timed_out`);
- a connection cap: past `max_connections`, the connection that has waited longest for a
  request head is closed to make room (a client that sends its request at once is served
  beside thousands that send nothing); if every connection holds a request, the new one gets
  a 503 with `Retry-After` and is closed;
- lingering closes: a connection closed while its client may still be sending (a 413 from the
  declared size, the 408, the 503) shuts its sending side, then reads and drops what arrives
  for up to LINGER_S before it closes, so the client reads the answer instead of a reset.

Closing is counted, and logged once per interval with a count (request_log.Throttled).
"""
from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from spd_engine.server.request_log import Throttled

LINGER_S = 2.0  # how long a closing connection still reads and drops what its client sends
LINGER_BYTES = 64 << 20  # ... and at most this much
MAX_LINGERING = 64  # beyond: close at once (each lingering connection holds a descriptor)


class ConnectionGuard:
    """What the connections of one server share: the limits, who waits for a head, the log."""

    def __init__(self, header_s: float, body_s: float, max_connections: int) -> None:
        self.header_s, self.body_s, self.max_connections = header_s, body_s, max_connections
        self.waiting: dict[GuardedH11Protocol, float] = {}  # waiting for a request head, oldest first
        self.lingering = 0
        self.closing = 0  # closed by us, not yet gone from uvicorn's set of connections
        self.log = Throttled()

    def oldest_waiting(self, other_than: GuardedH11Protocol) -> GuardedH11Protocol | None:
        return next((p for p in self.waiting if p is not other_than), None)


class LingeringTransport:
    """The transport a connection's requests see: close() lingers while the client may still send."""

    def __init__(self, raw: asyncio.Transport, protocol: GuardedH11Protocol) -> None:
        self._raw, self._protocol = raw, protocol

    def __getattr__(self, name: str) -> Any:
        return getattr(self._raw, name)

    def is_closing(self) -> bool:
        return self._protocol.lingering or self._raw.is_closing()

    def close(self) -> None:
        self._protocol.close_lingering()


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with the deadlines, the cap and lingering closes above."""

    guard: ConnectionGuard  # set by guarded_protocol()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.lingering = False
        self._lingered = 0
        self._closed = False  # counted in guard.closing
        self._timer: asyncio.TimerHandle | None = None
        self._raw: asyncio.Transport | None = None

    # -- the connection's life --

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._raw = transport
        self.transport = LingeringTransport(transport, self)  # type: ignore[assignment]
        if len(self.connections) - self.guard.closing > self.guard.max_connections:
            victim = self.guard.oldest_waiting(self)
            if victim is None:
                self._refuse()
                return
            self.guard.log.event("connections", "closed %d connection(s) waiting for a request head to make room "
                                 "(--max-connections %d)", self.guard.max_connections)
            victim.close_now()
        self._await_head()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timer()
        self.guard.waiting.pop(self, None)
        if self.lingering:
            self.lingering = False
            self.guard.lingering -= 1
        if self._closed:
            self._closed = False
            self.guard.closing -= 1
        super().connection_lost(exc)

    def shutdown(self) -> None:
        """The server stops: a closing connection just closes (its answer was written past h11)."""
        if self.lingering or self._raw is None or self._raw.is_closing():
            self.close_now()
            return
        super().shutdown()

    def data_received(self, data: bytes) -> None:
        if self.lingering:  # the answer is out: drop what the client still sends
            self._lingered += len(data)
            if self._lingered > LINGER_BYTES:
                self.close_now()
            return
        super().data_received(data)

    def handle_events(self) -> None:
        before = self.cycle
        super().handle_events()
        if self.lingering or self._raw is None or self._raw.is_closing():
            return
        if self.cycle is not before:  # a request head arrived
            self.guard.waiting.pop(self, None)
            self._cancel_timer()
            if self.conn.their_state is h11.SEND_BODY:
                self._timer = self.loop.call_later(self.guard.body_s, self._body_late)
        elif self._timer is not None and self.guard.waiting.get(self) is None \
                and self.conn.their_state is not h11.SEND_BODY:
            self._cancel_timer()  # the body is complete

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and self.conn.their_state is h11.IDLE and self._timer is None:
            self._await_head()  # kept alive: the next head has its own deadline

    # -- deadlines --

    def _await_head(self) -> None:
        self.guard.waiting[self] = time.monotonic()
        self._cancel_timer()
        self._timer = self.loop.call_later(self.guard.header_s, self._head_late)

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _head_late(self) -> None:
        self._timer = None
        self.guard.log.event("header", "closed %d connection(s) that sent no complete request head within %g s "
                             "(--header-timeout)", self.guard.header_s)
        self.close_now()

    def _body_late(self) -> None:
        self._timer = None
        self.guard.log.event("body", "ended %d request(s) whose body did not arrive within %g s (--body-timeout)",
                             self.guard.body_s)
        cycle = self.cycle
        if cycle is not None and not cycle.response_started:
            cycle.scope["spd.timed_out"] = "body"  # type: ignore[typeddict-unknown-key]
            self._answer(408, "Request Timeout", f"the request body did not arrive within {self.guard.body_s:g} s",
                         "request_timeout", {})
            cycle.response_started = cycle.response_complete = True
        if cycle is not None:
            cycle.disconnected = True  # the handler's receive() says the client went away
            cycle.message_event.set()
        self.close_lingering()

    # -- answers and closes --

    def _answer(self, status: int, reason: str, message: str, code: str, headers: dict[str, str]) -> None:
        """A JSON error in OpenAI's shape, written by the connection itself (no handler runs)."""
        body = json.dumps({"error": {"message": message, "type": "invalid_request_error" if status < 500
                                     else "server_error", "param": None, "code": code}}).encode()
        head = [f"HTTP/1.1 {status} {reason}", "Content-Type: application/json", f"Content-Length: {len(body)}",
                "Connection: close", *(f"{k}: {v}" for k, v in headers.items())]
        self._raw.write(("\r\n".join(head) + "\r\n\r\n").encode() + body)

    def _refuse(self) -> None:
        self.guard.log.event("refused", "refused %d connection(s) with 503: %d connections, each holding a request "
                             "(--max-connections)", self.guard.max_connections)
        self._answer(503, "Service Unavailable", "too many open connections; retry shortly", "too_many_connections",
                     {"Retry-After": "1"})
        self.close_lingering()

    def close_now(self) -> None:
        """Close at once; it no longer counts against the cap (nor is it evicted twice)."""
        self.guard.waiting.pop(self, None)
        self._cancel_timer()
        if self._raw is not None and not self._raw.is_closing():
            self._raw.close()
            if not self._closed:
                self._closed = True
                self.guard.closing += 1

    def close_lingering(self) -> None:
        """Close; while the client may still be sending, first shut our side and drop what arrives."""
        raw = self._raw
        if raw is None or raw.is_closing() or self.lingering:
            if not self.lingering:
                self.close_now()
            return
        # mid-body, or refused before its request: the client may be writing while we close
        still_sending = self.conn.their_state is h11.SEND_BODY or self.cycle is None
        if not still_sending or self.guard.lingering >= MAX_LINGERING or not raw.can_write_eof():
            raw.close()
            return
        try:
            raw.write_eof()
        except OSError:  # the client is gone already
            raw.close()
            return
        self.lingering = True
        self.guard.lingering += 1
        self.guard.waiting.pop(self, None)
        self._cancel_timer()
        if self.flow is not None:
            self.flow.resume_reading()
        self.loop.call_later(LINGER_S, self.close_now)


def guarded_protocol(guard: ConnectionGuard) -> type[GuardedH11Protocol]:
    """The protocol class for uvicorn's `http=`, bound to one server's guard."""
    return type("ServeH11Protocol", (GuardedH11Protocol,), {"guard": guard})

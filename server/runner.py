"""The life of a `spd serve` process: uvicorn in the main thread, the engine thread beside it.

- SIGTERM / SIGINT: a drain (serve_signals): new requests get 503 while the held ones finish,
  then the ranks shut down: exit 0; past the drain timeout the held requests are ended in
  OpenAI's shape: exit 1.
- The engine fails (a stage rank died or stalled): the request in flight got its 500 and queued
  ones a 503, the spawned ranks are killed; /health answers 503 for `unhealthy_grace_s`, then the
  server stops: exit 1. Should anything still block, the process kills its ranks and exits 1 at
  `exit_deadline_s` after the failure regardless, so a supervisor sees it go and restarts it.
"""
from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import sys
import threading

import uvicorn

from spd_engine.server.engine_loop import EngineLoop
from spd_engine.server.limits import BACKLOG
from spd_engine.server.request_log import Throttled
from spd_engine.server.signals import Drain

LOG = logging.getLogger("spd.serve")
CLOSE_S = 5.0  # after the drain: time for the last responses to be written before uvicorn cancels them


class DrainingServer(uvicorn.Server):
    """uvicorn's server; SIGTERM and SIGINT start a drain (serve_signals.Drain) instead of stopping at once."""

    def __init__(self, config: uvicorn.Config, engine: EngineLoop, drain_timeout_s: float) -> None:
        super().__init__(config)
        self.engine = engine
        self.drain = Drain(self, engine, drain_timeout_s)

    def handle_exit(self, sig, frame) -> None:
        self.drain.on_signal(sig)

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        asyncio.get_running_loop().set_exception_handler(throttled_loop_errors())
        await super().serve(sockets)


def throttled_loop_errors(log: Throttled | None = None):
    """An event-loop exception handler that logs each kind of error once per interval with a count
    (asyncio's own logs accept() out of descriptors once per attempt: a million lines a minute)."""
    log = log or Throttled()

    def on_loop_error(loop: asyncio.AbstractEventLoop, context: dict) -> None:
        err = context.get("exception")
        message = context.get("message", "event loop error")
        log.event(message, "event loop: %d x %s%s", message, f" ({type(err).__name__}: {err})" if err else "",
                  level=logging.ERROR)
    return on_loop_error


def bind(host: str, port: int) -> socket.socket:
    """A listening socket (port 0: any free port), so the address is known before the server runs."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {err}") from None
    sock.listen(BACKLOG)
    return sock


def _hard_exit(engine: EngineLoop, reason: str) -> None:
    print(f"spd serve: still running after the failure ({reason}); exiting", file=sys.stderr, flush=True)
    engine.kill_ranks()
    os._exit(1)


def run_server(engine: EngineLoop, app, sock: socket.socket, drain_timeout_s: float, unhealthy_grace_s: float,
               exit_deadline_s: float, log_level: str = "warning", protocol: type | None = None) -> int:
    """Serve until a signal or an engine failure; the exit code (0 drained, 1 failed). `protocol`:
    uvicorn's HTTP protocol class (server/connections.py), else uvicorn's own."""
    config = uvicorn.Config(app, log_config=None, log_level=log_level, timeout_graceful_shutdown=CLOSE_S,
                            lifespan="off", access_log=False, http=protocol or "auto", backlog=BACKLOG)
    server = DrainingServer(config, engine, drain_timeout_s)

    def on_fatal(reason: str) -> None:
        print(f"spd serve: unhealthy: {reason}", file=sys.stderr, flush=True)
        timers = (threading.Timer(unhealthy_grace_s, lambda: setattr(server, "should_exit", True)),
                  threading.Timer(exit_deadline_s, _hard_exit, args=(engine, reason)))
        for timer in timers:
            timer.daemon = True
            timer.start()

    engine.on_fatal = on_fatal
    if engine.state == "failed":  # failed between start-up and now
        on_fatal(engine.failure or "the engine failed")
    host, port = sock.getsockname()[:2]
    print(f"spd serve: ready on http://{host}:{port}", file=sys.stderr, flush=True)
    # uvicorn restores the handlers it found and re-raises the signal it caught: let it find ours,
    # so the re-raised SIGTERM drains (a no-op by then) instead of killing the process mid-shutdown.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, server.handle_exit)
    server.run(sockets=[sock])
    # a drained engine ends at once; an aborted request stops at its next token (or its rank is hung)
    if not engine.stop(timeout=CLOSE_S if engine.state == "failed" or server.drain.expired else drain_timeout_s):
        print("spd serve: the engine did not stop in time; killing the ranks", file=sys.stderr, flush=True)
        engine.kill_ranks()
        return 1
    if engine.state == "failed" or server.drain.expired:
        engine.kill_ranks()
        return 1
    print("spd serve: drained, ranks shut down", file=sys.stderr, flush=True)
    return 0

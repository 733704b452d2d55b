"""The life of a `spd serve` process: uvicorn in the main thread, the engine thread beside it.

- SIGTERM / SIGINT: the engine refuses new requests (503), uvicorn stops listening and waits up
  to the drain timeout for the requests it holds (queued ones included) to finish, cancels what
  is left (each ends at its next token), then the ranks shut down: exit 0.
- The engine fails (a stage rank died): the request in flight got its 500 and queued ones a 503;
  /health answers 503 for `unhealthy_grace_s`, then the server stops: exit 1. Should anything
  still block, the process exits 1 at `exit_deadline_s` after the failure regardless, so a
  supervisor sees it go and restarts it.
"""
from __future__ import annotations

import os
import signal
import socket
import sys
import threading

import uvicorn

from spd_engine.server.engine_loop import EngineLoop


class DrainingServer(uvicorn.Server):
    """uvicorn's server; the exit signal first stops the engine taking requests."""

    def __init__(self, config: uvicorn.Config, engine: EngineLoop) -> None:
        super().__init__(config)
        self.engine = engine

    def handle_exit(self, sig, frame) -> None:
        self.engine.drain()
        super().handle_exit(sig, frame)


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
    sock.listen(1024)
    return sock


def _hard_exit(reason: str) -> None:
    print(f"spd serve: still running after the failure ({reason}); exiting", file=sys.stderr, flush=True)
    os._exit(1)


def run_server(engine: EngineLoop, app, sock: socket.socket, drain_timeout_s: float, unhealthy_grace_s: float,
               exit_deadline_s: float, log_level: str = "warning") -> int:
    """Serve until a signal or an engine failure; the exit code (0 drained, 1 failed)."""
    config = uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=drain_timeout_s, lifespan="off",
                            access_log=False)
    server = DrainingServer(config, engine)

    def on_fatal(reason: str) -> None:
        print(f"spd serve: unhealthy: {reason}", file=sys.stderr, flush=True)
        timers = (threading.Timer(unhealthy_grace_s, lambda: setattr(server, "should_exit", True)),
                  threading.Timer(exit_deadline_s, _hard_exit, args=(reason,)))
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
    if not engine.stop(timeout=drain_timeout_s):
        print("spd serve: the engine did not stop in time", file=sys.stderr, flush=True)
        return 1
    if engine.state == "failed":
        return 1
    print("spd serve: drained, ranks shut down", file=sys.stderr, flush=True)
    return 0

"""Signals and the drain of `spd serve`.

SIGTERM or SIGINT (Ctrl-C, or either sent to the whole process group: `timeout`, systemd and
Kubernetes do; the ranks ignore both, engine/runtime/launch.py) starts a drain: the server keeps listening
so new requests get a 503 `draining` with Retry-After (a load balancer sees the drain, instead of
a refused connection), while the requests it holds, queued ones included, run to their end. Once
none is left, uvicorn stops listening and the server exits 0. Past `--drain-timeout` (or at a
second signal) every held request is ended in OpenAI's shape: a stream gets an error event and
`data: [DONE]`, a waiting request a 503; the server then stops and exits 1.
"""
from __future__ import annotations

import logging
import threading
import time

import uvicorn

from spd_engine.server.engine_loop import EngineLoop

LOG = logging.getLogger("spd.serve")
POLL_S = 0.05


class Drain:
    """The drain of one server: `on_signal` from the signal handler, a thread waits for the end."""

    def __init__(self, server: uvicorn.Server, engine: EngineLoop, timeout_s: float) -> None:
        self.server, self.engine, self.timeout_s = server, engine, timeout_s
        self.started = False
        self.expired = False  # the deadline passed (or a second signal came) with requests held
        self._now = threading.Event()
        self._thread: threading.Thread | None = None

    def on_signal(self, sig: int) -> None:
        """The first signal starts the drain; a second ends it at once. Runs in the signal handler:
        it only flags and starts a thread."""
        if self.server.should_exit:
            return  # stopping already
        if self.started:
            self._now.set()
            return
        self.started = True
        self.engine.drain()
        self._thread = threading.Thread(target=self._run, args=(sig,), name="spd-drain", daemon=True)
        self._thread.start()

    def _run(self, sig: int) -> None:
        held = self.engine.open_jobs()
        LOG.warning("signal %d: draining %d held request(s); new requests get 503 (deadline %g s)", sig, held,
                    self.timeout_s)
        deadline = time.monotonic() + self.timeout_s
        while (self.engine.open_jobs() > 0 and self.engine.state != "failed" and time.monotonic() < deadline
               and not self._now.wait(POLL_S)):
            pass
        left = self.engine.open_jobs()
        if left > 0 and self.engine.state != "failed":
            self.expired = True
            why = "a second signal came" if self._now.is_set() else f"the drain deadline of {self.timeout_s:g} s passed"
            ended = self.engine.abort(f"the server is shutting down: {why} before this request finished")
            LOG.error("drain: %s with %d request(s) held; ended them with 503", why, ended)
        self.server.should_exit = True

"""The log of `spd serve`: Python `logging` to stderr, one line per record.

One INFO line per request (its id, endpoint, status, tokens, time to first token, total time and
how it ended); warnings and errors are single lines too (an exception becomes `Type: message` on
the line; its traceback only at DEBUG). uvicorn's own loggers go through the same handler. An
event that can repeat thousands of times a second (connections closed at a deadline, accept()
out of descriptors) is logged once per interval with a count (Throttled), never once per event.
"""
from __future__ import annotations

import logging
import sys
import time

LEVELS = ("critical", "error", "warning", "info", "debug")
DEFAULT_LEVEL = "info"
LOG = logging.getLogger("spd.serve")
THROTTLE_S = 10.0


class Throttled:
    """Repeated events, each kind logged at most once per `interval_s` with the count since its last line."""

    def __init__(self, interval_s: float = THROTTLE_S, clock=time.monotonic) -> None:
        self.interval_s, self.clock = interval_s, clock
        self.counts: dict[str, int] = {}  # events since the kind's last line
        self.totals: dict[str, int] = {}
        self._last: dict[str, float] = {}

    def event(self, kind: str, message: str, *args, level: int = logging.WARNING) -> None:
        """Count one event of `kind`; `message` has a %d for the count first, then `args`."""
        self.counts[kind] = self.counts.get(kind, 0) + 1
        self.totals[kind] = self.totals.get(kind, 0) + 1
        now = self.clock()
        if now - self._last.get(kind, -self.interval_s) >= self.interval_s:
            LOG.log(level, message, self.counts[kind], *args)
            self.counts[kind], self._last[kind] = 0, now


class OneLineFormatter(logging.Formatter):
    """`time LEVEL logger: message`, with any exception on the same line (traceback at DEBUG only)."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        exc, record.exc_info, text = record.exc_info, None, None
        try:
            text = super().format(record).replace("\n", " | ")
        finally:
            record.exc_info = exc
        if exc and exc[1] is not None:
            text += f" ({type(exc[1]).__name__}: {exc[1]})"
            if LOG.isEnabledFor(logging.DEBUG):
                text += "\n" + self.formatException(exc)
        return text


def configure(level: str) -> None:
    """Send spd.serve and uvicorn records at `level` and above to stderr, one line each."""
    if level not in LEVELS:
        raise ValueError(f"--log-level must be one of {', '.join(LEVELS)}, got {level!r}")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(OneLineFormatter())
    for name in ("spd", "uvicorn", "uvicorn.error"):
        logger = logging.getLogger(name)
        logger.handlers[:] = [handler] if name != "uvicorn.error" else []
        logger.setLevel(level.upper())
        logger.propagate = name == "uvicorn.error"  # into "uvicorn"
    logging.getLogger("uvicorn.access").disabled = True  # the request line below says more


def request_line(request_id: str, path: str, status: int, prompt_tokens: int | None, completion_tokens: int | None,
                 ttft_s: float | None, total_s: float, finish: str | None) -> None:
    """The one log line of a finished (or refused) request."""
    def opt(v, fmt="{}"):
        return "-" if v is None else fmt.format(v)

    level = logging.ERROR if status >= 500 else logging.INFO
    LOG.log(level, "request %s %s %d prompt_tokens=%s completion_tokens=%s ttft=%s total=%.3fs finish=%s",
            request_id, path, status, opt(prompt_tokens), opt(completion_tokens), opt(ttft_s, "{:.3f}s"), total_s,
            opt(finish))

"""One request of `spd serve` as the engine thread sees it: it detokenizes every committed token,
cuts at stop strings and hands pieces to its asyncio queue (("piece", text, scored), then ("done",
Summary) or ("error", ApiError)); and a function run on the engine thread with the runtime.

`scored` is None unless log-probabilities were asked; then it lists those of the tokens committed
since the last piece (a piece may hold several tokens, and a token may hold no text yet), so the
pieces of a reply carry every token's once, the last ones with the closing piece."""
from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

from spd_engine.engine.model.tokenizer import Tokenizer
from spd_engine.engine.protocol.batch_policy import CRITICAL
from spd_engine.engine.protocol.metrics import GenerationResult
from spd_engine.server.openai_api import ApiError
from spd_engine.server.request import ServeRequest
from spd_engine.server.responses import Scored, Summary
from spd_engine.server.text import TextStream

# the run figures a finished request reports (GenerationResult fields)
SPD_FIELDS = ("ticks", "verified", "accepted", "rejections", "alpha", "eal", "prefill_s", "decode_s",
              "decode_tok_s")


class Job:
    """One request (one choice of a reply). The engine thread calls on_token / finish / fail; the
    event loop reads `events`: ("piece", text, scored), then ("done", Summary) or ("error", ApiError)."""

    def __init__(self, req: ServeRequest, tok: Tokenizer | None, loop: asyncio.AbstractEventLoop,
                 index: int = 0) -> None:
        self.req, self.loop, self.tok, self.index = req, loop, tok, index
        self.asks_logprobs = req.parsed.logprobs is not None
        self._scored: list[Scored] = []  # log-probabilities of the tokens not yet handed over with a piece
        self.text = TextStream(tok, req.stops)
        self.events: asyncio.Queue = asyncio.Queue()
        self.arrival = time.monotonic()
        self.started: float | None = None
        self.token_times: list[float] = []  # commit time of every token of the reply
        self.cancel_reason: str | None = None  # "cancelled" (client gone) or "timeout"; set by the event loop
        self.cancel_asked: tuple[float, int] | None = None  # (when, tokens committed by then): for the metrics
        self.finish_reason: str | None = None  # stop / length / cancelled / timeout / error
        self.result: GenerationResult | None = None
        self.eos: set[int] = set()  # the ids that end it (set when it enters the pipeline)
        self.request_id: str = ""  # the HTTP side's id (X-Request-Id), for the log
        self.on_close: Callable[[], None] | None = None  # frees the job's place in the server (EngineLoop)
        self._lock = threading.Lock()
        self._closed = False

    def close(self) -> bool:
        """Mark the job ended (once) and free its place; False if it had ended already."""
        with self._lock:
            if self._closed:
                return False
            self._closed = True
        if self.on_close is not None:
            self.on_close()
        return True

    @property
    def queue_rank(self) -> tuple[int, int]:
        """Its place in the queue's order, smaller first: critical before batch, then higher priority
        (arrival order breaks ties: JobQueue)."""
        return (0 if self.req.latency == CRITICAL else 1, -self.req.priority)

    @property
    def last_progress(self) -> float:
        """When the job last moved: its last token, else its entry into the pipeline."""
        return self.token_times[-1] if self.token_times else (self.started or self.arrival)

    def _emit(self, event: tuple) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the event loop is gone (server shut down): nobody is listening
            pass

    def ask_cancel(self, reason: str) -> None:
        """Called on the event loop: end at the next token (the engine thread reads cancel_reason there)."""
        if self.cancel_reason is None:
            self.cancel_asked = (time.monotonic(), len(self.token_times))
            self.cancel_reason = reason

    def after_cancel(self) -> tuple[float, int] | None:
        """Seconds and tokens from the cancel until now (called as the request ends); None if not cancelled."""
        if self.cancel_asked is None:
            return None
        asked, tokens = self.cancel_asked
        return time.monotonic() - asked, len(self.token_times) - tokens

    def _piece(self, text: str) -> None:
        """Hand a piece of text over, with the log-probabilities of the tokens behind it."""
        scored = None
        if self.asks_logprobs:
            scored, self._scored = self._scored, []
        self._emit(("piece", text, scored))

    def on_token(self, token: int, scored: Scored | None = None) -> bool:
        """Called by the driver per committed token (`scored`: its log-probabilities, when asked);
        False ends the request after this token."""
        if self.finish_reason is not None:
            return False  # ended already (the driver ran on past a False)
        self.token_times.append(time.monotonic())
        if scored is not None:
            self._scored.append(scored)
        piece = self.text.push(token)
        if piece:
            self._piece(piece)
        if self.text.stopped:
            self.finish_reason = "stop"
        elif self.cancel_reason is not None:
            self.finish_reason = self.cancel_reason
        return self.finish_reason is None

    def finish(self, res: GenerationResult, eos: set[int]) -> None:
        if not self.close():
            return
        self.result = res
        if self.finish_reason is None:
            tail = self.text.finish()
            if tail:
                self._piece(tail)
            if self.cancel_reason is not None:
                self.finish_reason = self.cancel_reason
            elif self.text.stopped or (res.tokens and res.tokens[-1] in eos):
                self.finish_reason = "stop"
            else:
                self.finish_reason = "length"
        spd = {k: getattr(res, k) for k in SPD_FIELDS}
        if self._scored:  # tokens that added no text (EOS, a cut stop string): their log-probabilities
            self._piece("")
        summary = Summary(self.finish_reason, len(self.req.prompt_ids), len(self.token_times), spd)
        if self.asks_logprobs:
            summary.logprobs = res.logprobs[:len(self.token_times)]
        self._emit(("done", summary))

    def fail(self, err: ApiError) -> bool:
        """Fail the request (once); False if it had ended already."""
        if not self.close():
            return False
        self.finish_reason = "error"
        self._emit(("error", err))
        return True


class DirectCall:
    """A function run on the engine thread with the runtime (the streaming-overhead benchmark runs
    `runtime.generate` itself there, exactly as `spd generate` does, on the server's own ranks)."""

    def __init__(self, fn: Callable[[Any], Any]) -> None:
        self.fn, self.done, self.value, self.error = fn, threading.Event(), None, None

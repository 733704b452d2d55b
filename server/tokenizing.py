"""Prompt tokenization for `spd serve`, off the event loop and bounded before it starts.

The `tokenizers` library holds the GIL while it encodes (about 1 s per MB here), so a thread would
not free the event loop: one large prompt would freeze every stream. Prompts are encoded (chat
template included) in one worker process instead, which loads the tokenizer once. Before that, a
prompt that cannot fit in the KV capacity is refused without being encoded: a token never covers
more than `max_token_bytes` bytes of text (the longest token of the vocabulary), so text longer
than capacity x that (x 2, for normalizers that drop characters) needs more tokens than fit, and
a chat of more turns than the capacity too (every turn takes a token at least).

The worker's work is bounded: at most MAX_PENDING encodes wait for it (one more gets a 503
`tokenizer_busy` with Retry-After), at most PER_CLIENT of them from one client address (one more
gets a 429 `tokenizer_busy`), and the worker takes them in fair-queuing order by client and size
(server/tokenizer_turns.py), so clients sending large prompts delay a small one by at most the
encode that is running. The client is the request's address (`CLIENT`, set per request by
http_guards.ClientAddress; behind a proxy on this host, uvicorn takes it from X-Forwarded-For).
A worker that died (out of memory, killed) is replaced before the next encode and whenever
/health asks (`revive`), which reports the restarts; an encode that was running when it died gets
a 500, since its prompt may be what killed it.
"""
from __future__ import annotations

import asyncio
import contextvars
import ctypes
import logging
import multiprocessing
import signal
import sys
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

from spd_engine.engine.model.tokenizer import Tokenizer
from spd_engine.server.openai_api import ApiError, ParsedRequest, bad
from spd_engine.server.tokenizer_turns import TokenizerTurns

SAFETY = 2  # text bytes per (longest token x capacity) refused outright
MAX_PENDING = 16  # encodes submitted to the worker and not yet done
PER_CLIENT = 2  # of those, from one client address
TURN_CHARS = 16  # what a chat turn adds to its text's size in the fair queue (the template's markup)
CLIENT: contextvars.ContextVar[str] = contextvars.ContextVar("spd_client", default="")  # the request's address
LOG = logging.getLogger("spd.serve")
_TOK: Tokenizer | None = None  # the worker process's tokenizer


def max_token_bytes(tok: Tokenizer) -> int:
    """An upper bound on the UTF-8 bytes of text one token covers (decoding a byte-level piece
    alone yields U+FFFD, 3 bytes: an over-estimate, which keeps the bound safe)."""
    backend = tok.backend
    longest = max((len(backend.decode([i], skip_special_tokens=False).encode("utf-8", "replace"))
                   for i in range(backend.get_vocab_size(with_added_tokens=True))), default=1)
    return max(1, longest)


def _init_worker(tok_dir: str) -> None:
    """The worker ignores Ctrl-C and SIGTERM (the server drains; it then shuts the pool down) and dies
    with the server (Linux: the parent's death kills it)."""
    global _TOK
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
        libc.prctl(15, b"spd-tokenizer", 0, 0, 0)  # PR_SET_NAME: how ps, top and /proc/PID/comm name it
    _TOK = Tokenizer.from_dir(tok_dir)


def _encode(chat: bool, payload, special: tuple[bool, bool] | None = None) -> tuple[bool, list[int] | str]:
    """(True, ids) or (False, the error's message): exceptions of the template engine stay here.
    special: /tokenize's (add_generation_prompt, add_special_tokens); None: a request's prompt."""
    from spd_engine.server.text import chat_ids, completion_ids, tokenize_ids

    try:
        if special is not None:
            ids = tokenize_ids(_TOK, payload, chat, _TOK.vocab_size, *special)
        else:
            ids = chat_ids(_TOK, payload) if chat else completion_ids(_TOK, payload, _TOK.vocab_size)
    except Exception as err:  # noqa: BLE001 - any refusal of the template or the tokenizer is the request's
        return False, str(err) or type(err).__name__
    return True, ids


class PromptEncoder:
    """Prompt ids of a request: refused early when they cannot fit; text encoded in a worker process."""

    def __init__(self, tok: Tokenizer | None, tok_dir: Path | None, capacity: int,
                 text_refusal: str | None = None) -> None:
        """text_refusal: why text is refused (a model with real weights and no tokenizer); token ids still pass."""
        self.tok, self.tok_dir, self.capacity = tok, tok_dir, capacity
        self.text_refusal = text_refusal
        self.byte_limit = SAFETY * capacity * max_token_bytes(tok) if tok is not None else capacity
        self._pool: ProcessPoolExecutor | None = None
        self.pending = 0
        self.restarts = 0
        self.turns = TokenizerTurns(PER_CLIENT)

    def start(self, wait: bool = True) -> None:
        """Start the worker (waiting for it before the server listens, so the first request does not)."""
        if self.tok is not None and self._pool is None:
            self._pool = ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"),
                                             initializer=_init_worker, initargs=(str(self.tok_dir),))
            warm = self._pool.submit(_encode, False, "warm")
            if wait:
                warm.result(timeout=120)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def check_size(self, parsed: ParsedRequest) -> None:
        """A prompt whose text alone needs more tokens than the KV capacity, or text the model cannot
        encode (text_refusal): a 400 before any encoding."""
        field = "messages" if parsed.chat else "prompt"
        if self.text_refusal is not None and (parsed.chat or not isinstance(parsed.prompt, list)):
            raise bad(field, self.text_refusal)
        if isinstance(parsed.prompt, list):
            size, unit = len(parsed.prompt), "token ids"
        else:
            texts = [text for _, text in parsed.messages] if parsed.chat else [parsed.prompt]
            size, unit = sum(len(t.encode("utf-8", "surrogatepass")) for t in texts), "bytes of text"
        limit = self.capacity if unit == "token ids" else self.byte_limit
        if parsed.chat and len(parsed.messages) > self.capacity:
            raise bad(field, f"{len(parsed.messages)} messages cannot fit in the KV capacity of {self.capacity} "
                             "positions (every turn takes a token at least)")
        if size > limit:
            raise bad(field, f"the prompt has {size} {unit}, more than can fit in the KV capacity of "
                             f"{self.capacity} positions")

    async def ids(self, parsed: ParsedRequest) -> list[int] | None:
        """The prompt ids, or None when the caller encodes inline (no tokenizer, or token ids given)."""
        self.check_size(parsed)
        if self._pool is None or (not parsed.chat and isinstance(parsed.prompt, list)):
            return None
        return await self.encode(parsed.chat, parsed.messages if parsed.chat else parsed.prompt)

    def revive(self) -> None:
        """Replace a worker that died since its last encode (a broken pool refuses new work at once)."""
        if self._pool is None:
            return
        try:
            self._pool.submit(int).cancel()
        except BrokenProcessPool:
            self._restart()

    def _restart(self) -> None:
        self.restarts += 1
        LOG.warning("the tokenizer process died; started a new one (%d restart(s) so far)", self.restarts)
        self._pool = None
        self.start(wait=False)

    async def encode(self, chat: bool, payload, special: tuple[bool, bool] | None = None) -> list[int]:
        """Ids of a prompt or chat turns, in the worker (started: a model with a tokenizer), when its turn
        comes (server/tokenizer_turns.py)."""
        assert self._pool is not None, "encode needs the worker (a model with a tokenizer)"
        if self.pending >= MAX_PENDING:
            raise ApiError(503, f"the tokenizer is busy ({MAX_PENDING} prompts wait for it); retry shortly",
                           type="server_error", code="tokenizer_busy", headers={"Retry-After": "1"})
        client = CLIENT.get()
        self.turns.admit(client)  # 429 before anything waits
        self.pending += 1
        try:
            await self.turns.acquire(client, payload_size(payload))
            ok, out = await self._run(client, chat, payload, special)
        finally:
            self.pending -= 1
        if not ok:
            raise bad("messages" if chat else "prompt", out)
        return out

    async def _run(self, client: str, chat: bool, payload, special) -> tuple[bool, list[int] | str]:
        """One encode in the worker, holding the turn of `client` until the worker is done with it (a
        request that leaves meanwhile does not hand the busy worker to the next one)."""
        submitted = False
        try:
            self.revive()
            pool = self._pool
            done = asyncio.wrap_future(pool.submit(_encode, chat, payload, special))
            submitted = True
        finally:
            if not submitted:
                self.turns.release(client)
        # the turn passes on when the worker is done; the outcome read, so an abandoned one is not logged
        done.add_done_callback(lambda fut: (fut.cancelled() or fut.exception(), self.turns.release(client)))
        try:
            return await asyncio.shield(done)
        except BrokenProcessPool:  # the worker died on this prompt (out of memory?): a fresh one for the next
            if self._pool is pool:  # not replaced yet (by another request that waited on it)
                self._restart()
            raise ApiError(500, "the tokenizer process failed on this request", type="server_error",
                           code="tokenizer_failed") from None


def payload_size(payload) -> int:
    """What an encode costs, for the fair queue: the characters of a prompt, or of a chat's turns."""
    if isinstance(payload, str):
        return len(payload)
    return sum(len(text) + len(role) + TURN_CHARS for role, text in payload)

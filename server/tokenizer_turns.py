"""Whose prompt the single tokenizer process encodes next: fair queuing by client and by size.

Encoding costs about its text's size (1-2.5 s per MB), and one worker does it all, so first come,
first served lets a few clients with large prompts delay everyone: four clients sending 2 MB chats
held an unrelated small request for seconds. Turns are given by start-time fair queuing instead:
each waiting encode gets the virtual finish tag max(now, its client's last tag) + its size, and
the smallest tag goes next. A client that has sent little (a small request, or one after a quiet
spell) is therefore served right after the encode that is running, whatever others have queued;
clients that keep sending share the worker in proportion to their bytes, not their requests.
Each client may have at most `per_client` encodes waiting or running (more get 429), which keeps
one client from filling the queue that every client shares.
"""
from __future__ import annotations

import asyncio
import heapq
import itertools
from collections import Counter

from spd_engine.server.openai_api import ApiError


class TokenizerTurns:
    """An async lock on the tokenizer worker, granted in fair-queuing order (see the module docstring)."""

    def __init__(self, per_client: int) -> None:
        self.per_client = per_client
        self.busy = False
        self.vtime = 0.0  # the start tag of the encode last given its turn
        self._finish: dict[str, float] = {}  # client -> finish tag of its last encode
        self._heap: list[tuple[float, int, float, asyncio.Future]] = []  # (finish tag, order, start tag, turn)
        self._order = itertools.count()  # equal tags: arrival order
        self.held = Counter()  # client -> encodes waiting or running

    def admit(self, client: str) -> None:
        """429 when `client` already has `per_client` encodes waiting or running."""
        if self.held[client] >= self.per_client:
            raise ApiError(429, f"this client already has {self.per_client} prompts waiting for the tokenizer; "
                                "retry when one is answered", code="tokenizer_busy", headers={"Retry-After": "1"})

    async def acquire(self, client: str, size: int) -> None:
        """Wait for the worker; counted against `client` until `release`."""
        self.admit(client)
        self.held[client] += 1
        start = max(self.vtime, self._finish.get(client, 0.0))
        self._finish[client] = start + size
        if not self.busy:
            self.busy, self.vtime = True, start
            return
        turn = asyncio.get_running_loop().create_future()
        heapq.heappush(self._heap, (start + size, next(self._order), start, turn))
        try:
            await turn
        except asyncio.CancelledError:
            if turn.done() and not turn.cancelled():  # granted as the caller left: pass the turn on
                self._forget(client)
                self._next()
            else:  # still queued: dropped when it comes up
                self._forget(client)
            raise

    def release(self, client: str) -> None:
        """The encode of `client` that held the worker is done."""
        self._forget(client)
        self._next()

    def _forget(self, client: str) -> None:
        self.held[client] -= 1
        if self.held[client] <= 0:
            del self.held[client]
            if self._finish.get(client, 0.0) <= self.vtime:
                self._finish.pop(client, None)  # idle, owed nothing: forgotten (memory stays bounded)

    def _next(self) -> None:
        """Give the worker to the waiting encode with the smallest finish tag, or mark it free."""
        while self._heap:
            _, _, start, turn = heapq.heappop(self._heap)
            if not turn.done():  # a cancelled waiter is done already
                self.vtime = max(self.vtime, start)
                turn.set_result(None)
                return
        self.busy = False
        self._finish = {c: t for c, t in self._finish.items() if c in self.held}  # idle: nobody is owed a turn

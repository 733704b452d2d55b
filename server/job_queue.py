"""The bounded queue of `spd serve`'s waiting requests, in docs/design.md 3.12's order:
latency-critical first, then higher priority, then arrival order; a function call queued between
them keeps its place in arrival order. The priority is the engine's (higher first): the request's
`priority` field negated, so the field orders as vLLM's, lower first (server/openai_api.py)."""
from __future__ import annotations

import threading
from collections import deque

from spd_engine.server.job import Job


class QueueFull(Exception):
    pass


def _rank(item) -> tuple[int, int] | None:
    """A job's queue_rank; None for anything else (a DirectCall), which keeps its place in arrival order."""
    return item.queue_rank if isinstance(item, Job) else None


class JobQueue:
    """Bounded queue of jobs waiting for the pipeline (the running ones are not counted). The next
    item is the first-ranked job (Job.queue_rank; the earliest among equals, so FIFO within a rank);
    an item without a rank (a DirectCall) is a barrier: the jobs queued after it wait until it has
    been taken, so it still runs after the requests queued before it."""

    def __init__(self, limit: int) -> None:
        assert limit >= 0
        self.limit = limit
        self._items: deque = deque()
        self._cv = threading.Condition()
        self._closed = False

    def __len__(self) -> int:
        return len(self._items)

    def put(self, item) -> None:
        with self._cv:
            if self._closed:
                raise QueueFull("closed")
            if len(self._items) >= self.limit:
                raise QueueFull(f"{len(self._items)} requests waiting (limit {self.limit})")
            self._items.append(item)
            self._cv.notify()

    def _next(self) -> int:
        """Where the next item is (the queue is not empty): the first-ranked job before the first
        barrier, or the barrier at the head."""
        best: tuple[tuple[int, int], int] | None = None
        for i, item in enumerate(self._items):
            rank = _rank(item)
            if rank is None:
                break  # the jobs behind a barrier arrived after it
            if best is None or rank < best[0]:  # strict: the earliest of equal rank stays first
                best = (rank, i)
        return 0 if best is None else best[1]

    def _pop(self, i: int):
        item = self._items[i]
        del self._items[i]
        return item

    def get_nowait(self, kind: type):
        """The next item if there is one and it is a `kind`, else None (never blocks)."""
        with self._cv:
            if not self._items:
                return None
            i = self._next()
            return self._pop(i) if isinstance(self._items[i], kind) else None

    def get(self):
        """The next item, or None once closed and empty (blocks until one of the two)."""
        with self._cv:
            while not self._items and not self._closed:
                self._cv.wait()
            return self._pop(self._next()) if self._items else None

    def remove(self, item) -> bool:
        with self._cv:
            try:
                self._items.remove(item)
                return True
            except ValueError:
                return False

    def close(self, discard: bool = False) -> list:
        """No more puts; get() returns what is left, then None. discard: also take out (and return) what is left."""
        with self._cv:
            self._closed = True
            left = list(self._items) if discard else []
            if discard:
                self._items.clear()
            self._cv.notify_all()
            return left

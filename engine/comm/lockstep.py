"""Lockstep in-process transport: every rank in one thread, a stage worker stepping as a message reaches it.

The reference executor's ranks are threads over FIFO queues (`LocalHub`). Here the same queues carry the
same messages, but a send to a stage rank runs that rank's `StageWorker.step` at once, on the sender's
thread, after the whole message (header and payloads) is queued. The driver's send into stage 0 thus runs
the pipeline for that entry down to the exit before the send returns, so a receive never waits: a
receive from an empty link is a protocol error, raised at once. Results are those of the threaded run,
because SPD's are timing-independent (docs/design.md 3.3/3.4) and every link stays FIFO; what is saved is
the threads' hand-offs (about a third of a tiny model's time per request). Not for TP stages, whose
ranks meet in collectives and so must run side by side.
"""
from __future__ import annotations

import queue
from collections.abc import Callable, Sequence

import torch

from spd_engine.engine.comm.transport import LocalHub, LocalTransport, TransportError
from spd_engine.engine.protocol.messages import Header


class LockstepHub(LocalHub):
    """LocalHub whose stage ranks step inline on the sender's thread (`attach` registers one)."""

    def __init__(self, world_size: int, errors: list[BaseException]) -> None:
        super().__init__(world_size)
        self.steps: dict[int, Callable[[], bool]] = {}  # rank -> its worker's step
        self.stepping: set[int] = set()
        self.errors = errors  # each failed step's error once (the executor's list), before the sender sees it

    def transport(self, rank: int) -> "LockstepTransport":
        return LockstepTransport(self, rank)

    def attach(self, rank: int, step: Callable[[], bool]) -> None:
        self.steps[rank] = step

    def deliver(self, dst: int) -> None:
        """Run `dst`'s step on the message just queued for it (no-op for a rank without a worker)."""
        step = self.steps.get(dst)
        if step is None:
            return
        # messages flow down the pipe and to the driver, never back up into a stage mid-step
        assert dst not in self.stepping, f"rank {dst} received a message while stepping"
        self.stepping.add(dst)
        try:
            with torch.no_grad():  # as StageWorker.serve
                step()
        except BaseException as err:  # the failing rank is recorded as dead, then the sender sees the error
            if not any(err is e for e in self.errors):  # not an error passing up from a later stage's step
                self.errors.append(err)
                self.dead.add(dst)
            raise
        finally:
            self.stepping.discard(dst)


class LockstepTransport(LocalTransport):
    def send(self, dst: int, header: Header, payloads: Sequence[torch.Tensor] = ()) -> None:
        super().send(dst, header, payloads)
        self.hub.deliver(dst)

    def _get(self, src: int, timeout: float | None, tick: int):
        try:
            return self.hub.links[(src, self.rank)].get_nowait()
        except queue.Empty:
            # everything a sent message causes has run by the time its send returns: nothing can come later
            raise TransportError(self.rank, src, tick, "lockstep receive found nothing queued") from None

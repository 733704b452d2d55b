"""The driver's end of the links from the stages (docs/design.md 3.3, 3.4), shared by the runtime's
driver and the tick replay (bench/tick_replay.py).

A stage's messages are read in order. The current-epoch message for a position is found by
dropping the stale ones a flush left in the pipe (their epoch is older; nothing else may come
first); what follows each header is read by the caller's `read_payloads(stage, header, where)`,
with `where` the caller's destination for the wanted message and None for a dropped one. At the
end of a request every link is drained up to the messages the request sent into the pipeline.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

from spd_engine.engine.comm.transport import Transport
from spd_engine.engine.protocol.messages import Header, Kind

ReadPayloads = Callable[[int, Header, object], None]  # (stage, header, where or None)


class StageLinks:
    """Reads the stages' messages to the driver; counts, per request, what was sent and read."""

    def __init__(self, transport: Transport, ranks: Sequence[int], reports: Sequence[bool], timeout: float,
                 read_payloads: ReadPayloads) -> None:
        self.t, self.ranks, self.reports, self.timeout = transport, list(ranks), list(reports), timeout
        self.read_payloads = read_payloads
        self.sent = 0  # token / prefill messages sent to stage 0 this request
        self.consumed = [0] * len(self.ranks)  # messages read from each stage this request

    def begin(self) -> None:
        """A new request: nothing sent or read yet."""
        self.sent = 0
        self.consumed = [0] * len(self.ranks)

    def ready(self, s: int) -> bool:
        return self.t.ready(self.ranks[s])

    def header(self, s: int, tick: int) -> Header:
        self.consumed[s] += 1
        return self.t.recv_header(self.ranks[s], self.timeout, tick)

    def find(self, s: int, kind: Kind, pos: int, epoch: int, tick: int, where: object = None,
             arrived_only: bool = False) -> Header | None:
        """Stage s's messages until the `epoch` one of `kind` for `pos`, its payloads to `where`;
        stale ones are dropped. arrived_only: None rather than wait for a message not yet there."""
        while True:
            if arrived_only and not self.t.ready(self.ranks[s]):
                return None
            hdr = self.header(s, tick)
            wanted = hdr.epoch == epoch and hdr.kind == kind and hdr.position == pos
            assert wanted or hdr.epoch < epoch, f"stage {s} sent {hdr}, the driver expected {kind.name}@{pos} " \
                                                f"in epoch {epoch}"
            self.read_payloads(s, hdr, where if wanted else None)
            if wanted:
                return hdr

    def drain(self, tick: int, stages: Sequence[int] | None = None) -> None:
        """Read what the stages still send for this request: one message per message sent, from
        every stage that reports to the driver."""
        for s in range(len(self.ranks)) if stages is None else stages:
            if self.reports[s]:
                while self.consumed[s] < self.sent:
                    self.read_payloads(s, self.header(s, tick), None)

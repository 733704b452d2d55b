"""How the driver hands messages to stage 0, in each of its layouts (docs/design.md 3.1, 3.3):

- a separate rank (every TP rank of stage 0 takes the message): a message;
- co-located, inline: a message over the loopback, then stage 0 steps on it here, in series;
- co-located, overlapped (n >= 2): stage 0 steps on its own thread (engine/runtime/stage0_overlap.py)
  while the driver drafts and verifies, joined at the end of the tick.
"""
from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from spd_engine.engine.comm.transport import Transport
from spd_engine.engine.protocol.messages import Header
from spd_engine.engine.protocol.topology import Topology
from spd_engine.engine.runtime.stage0_overlap import Stage0Runner
from spd_engine.engine.runtime.stage_worker import StageWorker


class Stage0Port:
    def __init__(self, topo: Topology, transport: Transport, local: StageWorker | None, overlap: bool,
                 device: torch.device) -> None:
        self.topo, self.t, self.local = topo, transport, local
        self.runner = Stage0Runner(local.step, device) if local is not None and overlap and topo.n >= 2 else None

    def send(self, hdr: Header, payloads: Sequence[torch.Tensor] = (), overlap: bool = False
             ) -> tuple[float, float] | None:
        """Post a message to stage 0; co-located, stage 0 steps on it now, inline, or (overlap, a
        decode tick) on its runner thread until `join` at the end of the tick. Returns the span
        (t0, t1) of an inline stage 0 step, else None."""
        for rank in self.topo.stage_ranks(0):  # every TP rank of stage 0 takes it (docs/design.md 3.9)
            self.t.send(rank, hdr, payloads)
        if overlap and self.runner is not None:
            self.runner.start()
        elif self.local is not None:  # co-located: stage 0 runs inline, in series with the driver
            t0 = time.perf_counter()
            self.local.step()
            return t0, time.perf_counter()
        return None

    def join(self) -> tuple[float, float] | None:
        """The end of an overlapped tick: the span (t0, t1) of the wait for stage 0's step, else None."""
        if self.runner is None:
            return None
        t0 = time.perf_counter()
        self.runner.join()
        return t0, time.perf_counter()

    def close(self) -> None:
        if self.runner is not None:
            self.runner.close()

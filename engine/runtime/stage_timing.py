"""A stage's decode statistics over one request: each decode step's wait, compute and send seconds,
its TP collectives, the optional trace, and the STATS reply that carries them to the driver at the
request's end (engine/protocol/metrics.py StageStats; prefill chunks are timed by the driver).
"""
from __future__ import annotations

import time

import torch

from spd_engine.engine.comm.tp_group import TPGroup
from spd_engine.engine.comm.transport import Transport
from spd_engine.engine.protocol.messages import Header, Kind
from spd_engine.engine.protocol.metrics import StageStats


class StageTiming:
    """This request's statistics of a stage rank; `group`: its TP stage group, or None."""

    def __init__(self, group: TPGroup | None, param_bytes: float, trace: bool) -> None:
        self.group, self.param_bytes = group, param_bytes  # this rank's parameter bytes (a TP rank: its shard)
        self.stats = StageStats()  # host floats: no per-tick tensors
        self.trace: list[float] | None = [] if trace else None  # (recv start, compute start, compute end)*

    def mark(self) -> tuple[int, float]:
        """The TP group's collective count and seconds so far, for `step` to take the difference."""
        return (self.group.calls, self.group.collective_s) if self.group is not None else (0, 0.0)

    @staticmethod
    def pad(min_step_s: float, t1: float) -> None:
        """A synthetic stage time (benchmarks, bubble tests): the compute begun at t1 lasts min_step_s."""
        time.sleep(max(0.0, min_step_s - (time.perf_counter() - t1)))

    def step(self, t0: float, t1: float, t2: float, mark: tuple[int, float], rows: int = 0) -> None:
        """A decode step: received from t0, computed from t1 to t2; `rows`: a BATCH step's rows."""
        s = self.stats
        s.compute_s += t2 - t1
        s.messages += 1
        s.rows += rows
        s.wait_s += t1 - t0
        if self.group is not None:
            s.tp_collectives += self.group.calls - mark[0]
            s.tp_collective_s += self.group.collective_s - mark[1]
        if self.trace is not None:
            self.trace += [t0, t1, t2]

    def send(self, t: Transport, driver: int) -> None:
        """The STATS reply: the statistics, the parameter bytes, the trace (float64)."""
        payload = torch.tensor([*self.stats.values(), self.param_bytes, *(self.trace or [])], dtype=torch.float64)
        t.send(driver, Header(Kind.STATS, length=payload.numel()), [payload])

    def reset(self) -> None:
        """A new request."""
        self.stats = StageStats()
        if self.trace is not None:
            self.trace.clear()

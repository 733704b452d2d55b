"""Stall detection for `spd serve`: a request in the pipeline that commits no token for the stall
deadline, and which stage rank went silent.

The driver's receives wait up to `--timeout` (60 s by default) for a rank, which is right for a
batch run but leaves a server's clients and its load balancer waiting a minute on a hung rank.
The server watches instead: a request that commits no token (prefill included) for `stall_s`
is stalled when a rank process is stopped (SIGSTOP, a debugger) or gone, or when no rank
process is computing (their CPU time, read from /proc, hardly advances: a rank waiting on a
deadlock or a lost message). Ranks that are computing (a long prefill on a slow host) are not
stalled; the driver's own receive timeout still bounds them. Linux /proc only; elsewhere, and
for ranks this process did not spawn (torchrun), the deadline alone decides and no rank is named.
"""
from __future__ import annotations

import os
import time
from collections import deque
from dataclasses import dataclass

CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
BUSY_FRACTION = 0.1  # rank CPU seconds per wall second (all ranks together) above which the ranks are computing
STOPPED_STATES = {"T": "stopped", "t": "stopped by a tracer", "Z": "exited (not yet reaped)", "X": "dead"}


@dataclass(frozen=True)
class RankSample:
    state: str | None  # /proc state letter; None: the process is gone
    cpu_s: float


def sample(pid: int) -> RankSample:
    """State letter and CPU seconds (user + system) of a process from /proc/PID/stat."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:  # gone, or no /proc
        return RankSample(None, 0.0)
    return RankSample(fields[0], (int(fields[11]) + int(fields[12])) / CLOCK_TICKS)


class StallWatch:
    """Call `check(last_progress)` periodically while a request runs; it returns the failure
    reason once the request is stalled. `ranks`: {rank: pid} of the spawned stage ranks."""

    def __init__(self, stall_s: float, ranks: dict[int, int] | None = None) -> None:
        if stall_s <= 0:
            raise ValueError(f"the stall deadline must be positive, got {stall_s}")
        self.stall_s = stall_s
        self.ranks = dict(ranks or {})
        self._cpu: deque[tuple[float, float]] = deque()  # (time, CPU seconds of all ranks)

    def reset(self) -> None:
        """A new request entered the pipeline: CPU use is measured from now on."""
        self._cpu.clear()

    def _silent_ranks(self, samples: dict[int, RankSample]) -> list[str]:
        return [f"stage rank {r} (pid {self.ranks[r]}) is {STOPPED_STATES.get(s.state, 'gone') if s.state else 'gone'}"
                for r, s in samples.items() if s.state is None or s.state in STOPPED_STATES]

    def _busy(self, now: float, cpu: float) -> bool:
        """Whether the ranks used CPU over the last stall window (they are computing, not silent)."""
        self._cpu.append((now, cpu))
        while len(self._cpu) > 2 and self._cpu[1][0] <= now - self.stall_s:
            self._cpu.popleft()
        t0, c0 = self._cpu[0]
        return now > t0 and (cpu - c0) / (now - t0) > BUSY_FRACTION

    def check(self, last_progress: float, now: float | None = None) -> str | None:
        now = time.monotonic() if now is None else now
        samples = {r: sample(pid) for r, pid in self.ranks.items()}
        busy = self._busy(now, sum(s.cpu_s for s in samples.values()))
        silent_for = now - last_progress
        if silent_for < self.stall_s:
            return None
        named = self._silent_ranks(samples)
        if named:
            return f"{'; '.join(named)}: no token for {silent_for:.1f} s (stall deadline {self.stall_s:g} s)"
        if not self.ranks:
            return f"no token for {silent_for:.1f} s (stall deadline {self.stall_s:g} s); the ranks are not watched"
        if busy:
            return None  # computing (a long prefill): the driver's receive timeout bounds it
        states = ", ".join(f"rank {r} pid {self.ranks[r]} state {s.state}" for r, s in samples.items())
        return (f"no token for {silent_for:.1f} s (stall deadline {self.stall_s:g} s) and no stage rank is "
                f"computing ({states})")

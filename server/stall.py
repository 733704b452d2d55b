"""Stall detection for `spd serve`: a request in the pipeline that commits no token for the stall
deadline, and which stage rank went silent.

The driver's receives wait up to `--timeout` (60 s by default) for a rank, which is right for a
batch run but leaves a server's clients and its load balancer waiting a minute on a hung rank.
The server watches instead: a request that commits no token (prefill included) for `stall_s`
is stalled when a rank process is stopped (SIGSTOP, a debugger) or gone, or when no rank
process is computing (their CPU time, read from /proc, hardly advances: a rank waiting on a
deadlock or a lost message). Ranks that are computing (a long prefill on a slow host) are not
stalled, nor are ranks waiting for a CPU (their run-queue wait, /proc/PID/schedstat, fills the
window: a host whose other processes take the cores, docs/serve.md); the driver's own receive
timeout still bounds both, and the second is logged once per request. Linux /proc only;
elsewhere, and for ranks this process did not spawn (torchrun), the deadline alone decides and
no rank is named.
"""
from __future__ import annotations

import logging
import os
import time
from collections import deque
from dataclasses import dataclass

CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
BUSY_FRACTION = 0.1  # rank CPU seconds per wall second (all ranks together) above which the ranks are computing
STARVED_FRACTION = 0.5  # rank run-queue seconds per wall second (all ranks together) above which they wait for a CPU
STOPPED_STATES = {"T": "stopped", "t": "stopped by a tracer", "Z": "exited (not yet reaped)", "X": "dead"}
LOG = logging.getLogger("spd.serve")


@dataclass(frozen=True)
class RankSample:
    state: str | None  # /proc state letter; None: the process is gone
    cpu_s: float
    wait_s: float = 0.0  # seconds its threads were runnable but waited for a CPU (0 where unknown)


def sample(pid: int) -> RankSample:
    """State letter and CPU seconds (user + system) of a process from /proc/PID/stat, and its
    run-queue wait from /proc/PID/schedstat (all its threads; absent without scheduler stats)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:  # gone, or no /proc
        return RankSample(None, 0.0)
    return RankSample(fields[0], (int(fields[11]) + int(fields[12])) / CLOCK_TICKS, _run_queue_wait_s(pid))


def _run_queue_wait_s(pid: int) -> float:
    """Sum over the process's threads of the second field of schedstat (nanoseconds spent runnable
    on a run queue); a thread's wait is counted when it next gets a CPU, so a starved rank's wait
    arrives in lumps."""
    total = 0
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0.0
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[1])
        except (OSError, IndexError, ValueError):  # the thread ended, or no scheduler stats
            continue
    return total / 1e9


class StallWatch:
    """Call `check(last_progress)` periodically while a request runs; it returns the failure
    reason once the request is stalled. `ranks`: {rank: pid} of the spawned stage ranks."""

    def __init__(self, stall_s: float, ranks: dict[int, int] | None = None) -> None:
        if stall_s <= 0:
            raise ValueError(f"the stall deadline must be positive, got {stall_s}")
        self.stall_s = stall_s
        self.ranks = dict(ranks or {})
        self._cpu: deque[tuple[float, float, float]] = deque()  # (time, CPU s, run-queue wait s) of all ranks
        self._told = False  # the wait for a CPU is logged once per request

    def reset(self) -> None:
        """A new request entered the pipeline: CPU use is measured from now on."""
        self._cpu.clear()
        self._told = False

    def _silent_ranks(self, samples: dict[int, RankSample]) -> list[str]:
        return [f"stage rank {r} (pid {self.ranks[r]}) is {STOPPED_STATES.get(s.state, 'gone') if s.state else 'gone'}"
                for r, s in samples.items() if s.state is None or s.state in STOPPED_STATES]

    def _rates(self, now: float, cpu: float, wait: float) -> tuple[float, float]:
        """(CPU seconds, run-queue seconds) of all ranks per wall second over the last stall window (a
        thread that ended takes its share of the sums with it, hence the clamp)."""
        self._cpu.append((now, cpu, wait))
        while len(self._cpu) > 2 and self._cpu[1][0] <= now - self.stall_s:
            self._cpu.popleft()
        t0, c0, w0 = self._cpu[0]
        return (max(0.0, cpu - c0) / (now - t0), max(0.0, wait - w0) / (now - t0)) if now > t0 else (0.0, 0.0)

    def check(self, last_progress: float, now: float | None = None) -> str | None:
        now = time.monotonic() if now is None else now
        samples = {r: sample(pid) for r, pid in self.ranks.items()}
        cpu_rate, wait_rate = self._rates(now, sum(s.cpu_s for s in samples.values()),
                                          sum(s.wait_s for s in samples.values()))
        silent_for = now - last_progress
        if silent_for < self.stall_s:
            return None
        named = self._silent_ranks(samples)
        if named:
            return f"{'; '.join(named)}: no token for {silent_for:.1f} s (stall deadline {self.stall_s:g} s)"
        if not self.ranks:
            return f"no token for {silent_for:.1f} s (stall deadline {self.stall_s:g} s); the ranks are not watched"
        if cpu_rate > BUSY_FRACTION:
            return None  # computing (a long prefill): the driver's receive timeout bounds it
        if wait_rate > STARVED_FRACTION:  # runnable, not silent: other processes hold the cores
            if not self._told:
                self._told = True
                LOG.warning("no token for %.1f s: the stage ranks are waiting for a CPU (%.2f s on the run queue "
                            "and %.2f s computing per second, all ranks together, over the last %g s); other "
                            "processes hold this host's cores", silent_for, wait_rate, cpu_rate, self.stall_s)
            return None
        states = ", ".join(f"rank {r} pid {self.ranks[r]} state {s.state}" for r, s in samples.items())
        return (f"no token for {silent_for:.1f} s (stall deadline {self.stall_s:g} s) and no stage rank is "
                f"computing ({states})")

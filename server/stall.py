"""Stall detection for `spd serve`: a request in the pipeline that commits no token for the stall
deadline, and which stage rank went silent.

The driver's receives wait up to `--timeout` (60 s by default) for a rank, which is right for a
batch run but leaves a server's clients and its load balancer waiting a minute on a hung rank.
The server watches instead: a request that commits no token (prefill included) for `stall_s`
is stalled when a rank process is stopped (SIGSTOP, a debugger) or gone, or when no rank
process is computing (each rank's CPU time, read from /proc, hardly advances: a rank waiting on
a deadlock or a lost message). Ranks that are computing (a long prefill on a slow host) are not
stalled, nor are ranks waiting for a CPU (a rank's run-queue time, /proc/PID/task/*/schedstat,
fills half the window, or half the window's samples find it runnable: a host whose other
processes take the cores, docs/serve.md); the driver's own receive timeout still bounds both,
and the second is logged once per job in the pipeline. Linux /proc only; elsewhere, and for
ranks this process did not spawn (torchrun), the deadline alone decides and no rank is named.

The watch also knows its own pauses: when two checks are further apart than half the deadline
(the caller checks every fraction of a second), the watcher itself did not run (the server
process was stopped: SIGSTOP, a VM pause or live migration, `docker pause`; or starved), and
neither could the driver take the ranks' tokens. What the window saw is then no evidence about
the ranks: the window restarts, and the silence counts from the resumption. Likewise silence
counts only from when the watcher first saw the job (reset), which it may see after a pause.
"""
from __future__ import annotations

import logging
import os
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
BUSY_FRACTION = 0.1  # CPU seconds per wall second of the busiest rank above which the ranks are computing
STARVED_FRACTION = 0.5  # run-queue seconds per wall second of one rank above which the ranks wait for a CPU
RUNNABLE_FRACTION = 0.5  # ... or the share of a window's samples that found one rank runnable (state R)
MIN_SAMPLES = 4  # samples a window needs before the runnable share counts
PAUSE_FRACTION = 0.5  # a gap between two checks over this share of the deadline: the watcher was paused
STOPPED_STATES = {"T": "stopped", "t": "stopped by a tracer", "Z": "exited (not yet reaped)", "X": "dead"}
LOG = logging.getLogger("spd.serve")


@dataclass(frozen=True)
class RankSample:
    state: str | None  # /proc state letter; None: the process is gone
    cpu_s: float
    wait_s: float = 0.0  # seconds its threads were runnable but waited for a CPU (0 where unknown)


def sample(pid: int) -> RankSample:
    """State letter and CPU seconds (user + system) of a process from /proc/PID/stat, and its
    threads' run-queue time from /proc/PID/task/*/schedstat (0 without scheduler stats)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:  # gone, or no /proc
        return RankSample(None, 0.0)
    return RankSample(fields[0], (int(fields[11]) + int(fields[12])) / CLOCK_TICKS, _run_queue_wait_s(pid))


def _run_queue_wait_s(pid: int) -> float:
    """Seconds the process's threads spent runnable on a run queue (schedstat's second field, summed)."""
    wait = 0
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0.0
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                wait += int(f.read().split()[1])
        except (OSError, IndexError, ValueError):  # the thread ended, or no scheduler stats
            continue
    return wait / 1e9


class StallWatch:
    """Call `check(last_progress)` periodically while a job (a request, or a batch of them) is in
    the pipeline; it returns the failure reason once the job is stalled. `ranks`: {rank: pid} of
    the spawned stage ranks. Ranks are judged one by one: a sum over ranks would let several
    ranks polling a peer that never answers pass for one that computes or waits for a CPU. Call it
    every fraction of a second: the runnable share counts from MIN_SAMPLES samples a window."""

    def __init__(self, stall_s: float, ranks: dict[int, int] | None = None,
                 on_cpu_wait: Callable[[], None] | None = None) -> None:
        if stall_s <= 0:
            raise ValueError(f"the stall deadline must be positive, got {stall_s}")
        self.stall_s = stall_s
        self.ranks = dict(ranks or {})
        self.on_cpu_wait = on_cpu_wait  # called when the warning is logged, once per job (the server's counter)
        self._window: deque[tuple[float, dict[int, RankSample]]] = deque()  # (time, samples), the last stall_s
        self._told = False  # the wait for a CPU is logged once per job
        self._last_check: float | None = None
        self._since = float("-inf")  # since when the watcher has seen the job without a pause of its own

    def reset(self, now: float | None = None) -> None:
        """A new job entered the pipeline: the ranks are judged from now on. Silence counts from
        here at the earliest (the server may have been paused between the job's start and the
        watcher seeing it), and a pause before the job's first check is one."""
        self._window.clear()
        self._told = False
        self._last_check = self._since = time.monotonic() if now is None else now

    def _paused(self, now: float) -> bool:
        """Whether the watcher itself was paused since its last check (and, if so, restart the window)."""
        last, self._last_check = self._last_check, now
        if last is None or now - last <= PAUSE_FRACTION * self.stall_s:
            return False
        LOG.warning("the stall watch did not run for %.1f s (the server process was paused or starved); the "
                    "ranks are judged again from now", now - last)
        self._window.clear()
        self._since = now
        return True

    def _silent_ranks(self, samples: dict[int, RankSample]) -> list[str]:
        return [f"stage rank {r} (pid {self.ranks[r]}) is {STOPPED_STATES.get(s.state, 'gone') if s.state else 'gone'}"
                for r, s in samples.items() if s.state is None or s.state in STOPPED_STATES]

    def _judge(self, now: float, samples: dict[int, RankSample]) -> tuple[float, float, float]:
        """Over the last stall window, the most of any one rank: CPU seconds per second, run-queue
        seconds per second (a thread that ended takes its share of a sum with it, hence the clamps),
        and the share of the window's samples that found it runnable. A thread's run-queue wait is
        counted only when it next gets a CPU, so a starved rank's arrives in lumps, and one kept off
        the CPUs for the whole window shows none: its state is what shows it then."""
        self._window.append((now, samples))
        while len(self._window) > 2 and self._window[1][0] <= now - self.stall_s:
            self._window.popleft()
        t0, first = self._window[0]
        if now <= t0 or not samples:
            return 0.0, 0.0, 0.0
        dt = now - t0
        cpu = max(max(0.0, s.cpu_s - first[r].cpu_s) / dt for r, s in samples.items())
        wait = max(max(0.0, s.wait_s - first[r].wait_s) / dt for r, s in samples.items())
        runnable = 0.0
        if len(self._window) >= MIN_SAMPLES:
            runnable = max(sum(seen[r].state == "R" for _, seen in self._window if r in seen) / len(self._window)
                           for r in samples)
        return cpu, wait, runnable

    def check(self, last_progress: float, now: float | None = None) -> str | None:
        now = time.monotonic() if now is None else now
        self._paused(now)
        samples = {r: sample(pid) for r, pid in self.ranks.items()}
        cpu_rate, wait_rate, runnable = self._judge(now, samples)
        silent_for = now - max(last_progress, self._since)  # a pause of the watcher is no silence of the ranks
        if silent_for < self.stall_s:
            return None
        named = self._silent_ranks(samples)
        if named:
            return f"{'; '.join(named)}: no token for {silent_for:.1f} s (stall deadline {self.stall_s:g} s)"
        if not self.ranks:
            return f"no token for {silent_for:.1f} s (stall deadline {self.stall_s:g} s); the ranks are not watched"
        if cpu_rate > BUSY_FRACTION:
            return None  # computing (a long prefill): the driver's receive timeout bounds it
        if wait_rate > STARVED_FRACTION or runnable >= RUNNABLE_FRACTION:  # not silent: other processes hold the cores
            if not self._told:
                self._told = True
                LOG.warning("no token for %.1f s: the stage ranks are waiting for a CPU (over the last %g s, the most "
                            "of one rank: %.2f s on the run queue and %.2f s computing per second, runnable in %.0f%% "
                            "of the samples); other processes hold this host's cores", silent_for, self.stall_s,
                            wait_rate, cpu_rate, 100 * runnable)
                if self.on_cpu_wait is not None:
                    self.on_cpu_wait()
            return None
        states = ", ".join(f"rank {r} pid {self.ranks[r]} state {s.state}" for r, s in samples.items())
        return (f"no token for {silent_for:.1f} s (stall deadline {self.stall_s:g} s) and no stage rank is "
                f"computing ({states})")

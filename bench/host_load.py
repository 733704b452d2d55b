"""A controlled competing load for `spd bench --host-load`: every row measured under the same load.

A shared host runs other processes beside the engine's ranks, and how much a row loses to them
depends on how its threads wait for each other (a pair of pipeline ranks, a 2-thread
autoregressive step, transformers' generate). `--host-load BUSY/IDLE[xN]` starts N processes that
each spin for BUSY ms and then sleep IDLE ms, over and over, for the whole benchmark, so every row
meets the same intermittent load and their slowdowns can be compared (docs/results/speed-2core-epyc.md, "Under a
competing load"). A load process ends itself when the benchmark's process is gone, so a killed
benchmark leaves none behind.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

# the load process: spin, sleep, and end when its parent is gone (its parent pid changes; the parent
# names itself, since a parent killed before the child starts would otherwise never be missed)
_SCRIPT = """
import os, sys, time
busy, idle, parent = float(sys.argv[1]) / 1e3, float(sys.argv[2]) / 1e3, int(sys.argv[3])
while os.getppid() == parent:
    end = time.perf_counter() + busy
    while time.perf_counter() < end:
        pass
    if idle > 0:
        time.sleep(idle)
"""
_SPEC = re.compile(r"^(\d+(?:\.\d+)?)/(\d+(?:\.\d+)?)(?:x(\d+))?$")
MAX_PROCESSES = 64


@dataclass(frozen=True)
class HostLoad:
    """N processes, each busy busy_ms then idle idle_ms in turn."""

    busy_ms: float
    idle_ms: float
    processes: int = 1

    def __post_init__(self) -> None:
        if not self.busy_ms > 0:
            raise ValueError(f"--host-load: a load process must be busy for some time, got {self.busy_ms} ms")
        if self.idle_ms < 0:
            raise ValueError(f"--host-load: idle time cannot be negative, got {self.idle_ms} ms")
        if not 1 <= self.processes <= MAX_PROCESSES:
            raise ValueError(f"--host-load: 1 to {MAX_PROCESSES} load processes, got {self.processes}")

    @classmethod
    def parse(cls, spec: str) -> "HostLoad":
        """'BUSY/IDLE' or 'BUSY/IDLE xN' (milliseconds; e.g. 2/6, 1000/0x2)."""
        m = _SPEC.match(spec.replace(" ", ""))
        if m is None:
            raise ValueError(f"--host-load takes BUSY/IDLE[xN] in milliseconds (e.g. 2/6 or 1000/0x2), got {spec!r}")
        return cls(float(m.group(1)), float(m.group(2)), int(m.group(3) or 1))

    @property
    def cores(self) -> float:
        """The cores the load would take on an otherwise idle host."""
        return self.processes * self.busy_ms / (self.busy_ms + self.idle_ms)

    def describe(self) -> str:
        each = "busy without pause" if self.idle_ms == 0 else f"busy {self.busy_ms:g} ms, idle {self.idle_ms:g} ms"
        return f"{self.processes} load process{'es' if self.processes > 1 else ''} ({each}: {self.cores:.2f} cores)"

    def to_dict(self) -> dict:
        return {"busy_ms": self.busy_ms, "idle_ms": self.idle_ms, "processes": self.processes, "cores": self.cores}


@contextmanager
def running(load: HostLoad | None) -> Iterator[list[subprocess.Popen]]:
    """Run the load's processes for the body of the with-statement (nothing for None)."""
    procs: list[subprocess.Popen] = []
    try:
        if load is not None:
            for _ in range(load.processes):
                argv = [sys.executable, "-c", _SCRIPT, str(load.busy_ms), str(load.idle_ms), str(os.getpid())]
                procs.append(subprocess.Popen(argv, stdin=subprocess.DEVNULL))
        yield procs
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait(timeout=10)

"""A `spd serve` process on 127.0.0.1 for tests and load benchmarks: start it, wait until it is
ready, find its address, stop it, and check that none of its processes is left behind.

The server leads a new process group (its spawned ranks included), so everything it started can
be found and, as a last resort, killed by group.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
import time
from pathlib import Path

from spd_engine.engine.runtime.launch import spd_command

READY = re.compile(r"spd serve: ready on (http://[\d.]+:\d+)")


def _file_limit(n: int):
    def set_limit() -> None:
        import resource

        resource.setrlimit(resource.RLIMIT_NOFILE, (n, n))
    return set_limit


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes of a process group."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # ended while we looked
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            pids.append(int(stat.parent.name))
    return pids


class ServerProcess:
    """`spd serve ARGS --host 127.0.0.1 --port 0`; stderr lines are kept with their arrival times."""

    def __init__(self, args: list[str], env: dict | None = None, ready_timeout: float = 300.0,
                 max_open_files: int | None = None) -> None:
        """`max_open_files`: the server's RLIMIT_NOFILE, soft and hard (as `ulimit -n N` sets it)."""
        self.args = list(args)
        cmd = [*spd_command(), "serve", *args, "--host", "127.0.0.1", "--port", "0"]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                     env={**os.environ, **(env or {})}, start_new_session=True,
                                     preexec_fn=_file_limit(max_open_files) if max_open_files else None)
        self.lines: list[tuple[float, str]] = []
        self.url: str | None = None
        self._ready = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        if not self._ready.wait(ready_timeout) or self.url is None:
            self.kill()
            raise RuntimeError(f"spd serve did not come up:\n{self.stderr()[-3000:]}")

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.lines.append((time.monotonic(), line.rstrip("\n")))
            m = READY.search(line)
            if m and self.url is None:
                self.url = m.group(1)
                self._ready.set()
        self._ready.set()  # the process ended (before or after it was ready)

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"

    def stderr(self) -> str:
        return "\n".join(line for _, line in self.lines)

    def wait(self, timeout: float = 60.0) -> int | None:
        """The exit code once the process has ended and its last stderr line is in `lines`
        (None if it did not end in time)."""
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None
        self._reader.join(timeout)  # the pipe's end: every line read
        return code

    def terminate(self, timeout: float = 60.0) -> int | None:
        """SIGTERM (a drain) and wait; the exit code, or None if it did not exit in time."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.wait(timeout)

    def spawned(self) -> list[int]:
        """Pids of the server's own worker processes: its stage ranks (`spd-rank-R`) and its tokenizer
        process (`spd-tokenizer`, where the model has a tokenizer); not the forkserver the ranks are
        forked from, nor multiprocessing's resource tracker."""
        pids = []
        for pid in group_members(self.proc.pid):
            try:
                if pid != self.proc.pid and Path(f"/proc/{pid}/comm").read_text().startswith("spd-"):
                    pids.append(pid)
            except OSError:  # ended while we looked
                continue
        return pids

    def leftovers(self, within: float = 10.0) -> list[int]:
        """Processes of the server's group still alive after `within` seconds."""
        deadline = time.monotonic() + within
        while (left := group_members(self.proc.pid)) and time.monotonic() < deadline:
            time.sleep(0.1)
        return left

    def kill(self) -> None:
        """Last resort: SIGKILL the whole group."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()

    def close(self) -> int | None:
        """Drain and stop; kill whatever is left. The drain's exit code (None: it had to be killed)."""
        code = self.terminate()
        if code is None or self.leftovers(5.0):
            self.kill()
        return code

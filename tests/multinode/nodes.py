"""Nodes as network namespaces on this host: each its own network stack and address, joined by a
veth pair, so ranks meet across a real network boundary (their loopback is their own, and an
address advertised on the wrong interface is unreachable from the other node).

Needs root and `ip` (iproute2); `namespaces_unusable()` says why not where they cannot be made.
Every namespace made here is removed by `Nodes.close()`, which first SIGKILLs the processes
still inside it (they were all started through `Nodes.popen`).
"""
from __future__ import annotations

import itertools
import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Sequence

# RFC 2544's benchmarking range: never routed, so it cannot clash with a real network
SUBNET = "198.18.0"
IFNAME = "spd0"  # the veth end's name inside each namespace
_made = itertools.count()


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def namespaces_unusable() -> str | None:
    """None where network namespaces and veth pairs can be made here, else the reason."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    probe = f"spdprobe{os.getpid()}"
    try:
        made = _ip("netns", "add", probe, check=False)
    except FileNotFoundError:
        return "no `ip` command (iproute2)"
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


class Nodes:
    """`count` namespaces, node i at SUBNET.(i+1)/24 on IFNAME; nodes 0 and 1 share one veth pair
    (two nodes are all the tests need)."""

    def __init__(self, count: int = 2) -> None:
        assert count == 2, "one veth pair joins two nodes"
        tag = f"{os.getpid() % 100000}x{next(_made)}"  # unique among this host's processes
        self.names = [f"spdn{tag}n{i}" for i in range(count)]
        self.addrs = [f"{SUBNET}.{i + 1}" for i in range(count)]
        self.procs: list[subprocess.Popen] = []
        try:
            self._make(tag)
        except BaseException:
            self.close()
            raise

    def _make(self, tag: str) -> None:
        for ns in self.names:
            _ip("netns", "add", ns)
            _ip("-n", ns, "link", "set", "lo", "up")
        ends = [f"spv{tag}y{i}" for i in range(2)]  # interface names: at most 15 characters
        _ip("link", "add", ends[0], "type", "veth", "peer", "name", ends[1])
        for end, ns, addr in zip(ends, self.names, self.addrs):
            _ip("link", "set", end, "netns", ns)
            _ip("-n", ns, "link", "set", end, "name", IFNAME)
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", IFNAME)
            _ip("-n", ns, "link", "set", IFNAME, "up")

    def popen(self, node: int, cmd: Sequence[str], env: dict[str, str] | None = None,
              **kwargs) -> subprocess.Popen:
        """Start `cmd` inside node `node`'s namespace (stdout and stderr piped, text)."""
        proc = subprocess.Popen(["ip", "netns", "exec", self.names[node], *cmd], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)
        self.procs.append(proc)
        return proc

    def gone(self, node: int, within_s: float) -> list[int]:
        """Wait up to `within_s` for node `node`'s namespace to empty; the pids still in it."""
        end = time.monotonic() + within_s
        while (left := self.pids(node)) and time.monotonic() < end:
            time.sleep(0.2)
        return left

    def pids(self, node: int) -> list[int]:
        """The processes still inside node `node`'s namespace."""
        out = _ip("netns", "pids", self.names[node], check=False).stdout
        return [int(p) for p in out.split()]

    def link(self, node: int, up: bool) -> None:
        """Bring node `node`'s end of the link up or down (a cut cable)."""
        _ip("-n", self.names[node], "link", "set", IFNAME, "up" if up else "down")

    def shape(self, node: int, rate: str, burst: str = "64kb") -> None:
        """Limit what node `node` sends over the link to `rate` (tc's token bucket, e.g. 100mbit):
        a slower link. Latency cannot be added this way (no netem in every kernel)."""
        subprocess.run(["ip", "netns", "exec", self.names[node], "tc", "qdisc", "replace", "dev", IFNAME, "root",
                        "tbf", "rate", rate, "burst", burst, "latency", "200ms"],
                       check=True, capture_output=True, text=True, timeout=30)

    def kill_node(self, node: int) -> None:
        """SIGKILL every process inside node `node`, as a machine that loses power."""
        for pid in self.pids(node):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def close(self) -> None:
        """Kill what is left inside the namespaces, reap it, and remove the namespaces (and the veth pair)."""
        for node in range(len(self.names)):
            self.kill_node(node)
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            try:
                proc.communicate(timeout=10)
            except (subprocess.TimeoutExpired, ValueError):
                pass
        for ns in self.names:
            _ip("netns", "del", ns, check=False)


class Lines:
    """A process's stderr read on a thread, each line with the time it arrived, so a test can wait
    for one (`wait_for`) while the process runs."""

    def __init__(self, stream) -> None:
        self.lines: list[tuple[float, str]] = []
        self._start = time.monotonic()
        self._thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._thread.start()

    def _read(self, stream) -> None:
        for line in stream:
            self.lines.append((time.monotonic() - self._start, line.rstrip("\n")))

    def wait_for(self, pattern: str, timeout_s: float) -> bool:
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if any(re.search(pattern, text) for _, text in self.lines):
                return True
            time.sleep(0.1)
        return False

    def text(self, timeout_s: float = 10.0) -> str:
        """Everything read, once the stream has ended (or `timeout_s` passed)."""
        self._thread.join(timeout_s)
        return "\n".join(text for _, text in self.lines)

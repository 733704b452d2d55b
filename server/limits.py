"""The HTTP limits of `spd serve` (no web framework imported here, so the CLI can check its flags
before it knows whether the `serve` extra is installed) and the open-file budget they live in.

Every connection holds one file descriptor. At start the soft open-file limit is raised to the
hard one, and the connection cap is kept below what is left of it after the descriptors the
process already holds, one accept burst (the listen backlog: the event loop accepts up to that
many connections before any of them is seen) and a margin for files opened later. A server at
its cap therefore never meets EMFILE in accept(), which asyncio would log once per attempt.
"""
from __future__ import annotations

import os

DEFAULT_MAX_REQUEST_BYTES = 2 << 20
DEFAULT_HEADER_TIMEOUT_S = 10.0  # connection open (or last response) to a complete request head
DEFAULT_BODY_TIMEOUT_S = 30.0  # complete head to the end of the body: 2 MiB at 70 KB/s
DEFAULT_MAX_CONNECTIONS = 1000
DEFAULT_MAX_IN_FLIGHT = 128  # requests between their head and the end of their answer (bodies held: 256 MiB at most)
BACKLOG = 128  # listen backlog, and so the most connections one accept burst takes
FD_MARGIN = 64  # descriptors kept free for files opened after start (logs, /proc reads, pipes)


def raise_open_file_limit() -> tuple[int, int]:
    """Raise the soft RLIMIT_NOFILE to the hard limit; (soft, hard) after. Where the platform has
    no such limit, (0, 0): the caller then keeps the configured cap."""
    try:
        import resource
    except ImportError:  # not POSIX
        return 0, 0
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):  # a container may refuse; the soft limit stays
            pass
    return soft, hard


def open_descriptors() -> int:
    """Descriptors this process holds now (0 where /proc/self/fd cannot be read)."""
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return 0


def connection_cap(wanted: int, soft_limit: int, in_use: int) -> int:
    """The connections the server may hold: `wanted`, lowered to fit the open-file limit; at least 1."""
    if soft_limit <= 0:
        return wanted
    return max(1, min(wanted, soft_limit - in_use - BACKLOG - FD_MARGIN))

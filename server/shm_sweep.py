"""Semaphores that a killed server left in /dev/shm, removed when the next one starts.

Python's multiprocessing names the semaphores of a spawned worker's queues (`/dev/shm/sem.mp-*`)
and unlinks them when they are freed, or, if the process dies first, from its resource tracker.
SIGKILL of the whole process group (a supervisor's last resort) kills the tracker too, and five
such files of the tokenizer process stay behind each time. A named semaphore is mapped into every
process that holds it open, so one of ours whose inode no process maps is held by nobody: the sweep
removes those (our user's `sem.mp-*` files only) and says how many.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

SHM = Path("/dev/shm")
PREFIX = "sem.mp-"


def mapped_inodes(proc: Path = Path("/proc")) -> set[int] | None:
    """Inodes of the /dev/shm files some process maps (glibc maps a semaphore under a temporary
    name, so the inode, not the name, identifies it); None when /proc cannot tell (then nothing
    may be removed)."""
    inodes: set[int] = set()
    readable = 0
    for maps in proc.glob("[0-9]*/maps"):
        try:
            text = maps.read_text()
        except OSError:  # ended while we looked, or not ours to read
            continue
        readable += 1
        for line in text.splitlines():
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].startswith(f"{SHM}/"):
                inodes.add(int(fields[4]))
    return inodes if readable else None


def sweep_semaphores(shm: Path = SHM, proc: Path = Path("/proc"), min_age_s: float = 5.0) -> int:
    """Remove our user's multiprocessing semaphores, older than `min_age_s`, that no process maps;
    how many were removed. The files are listed before the maps are read: glibc maps a semaphore
    before it gives it its name, so one listed first and held is always seen mapped."""
    if not shm.is_dir():
        return 0
    candidates = []
    for path in shm.glob(PREFIX + "*"):
        try:
            st = path.stat()
        except OSError:  # gone meanwhile
            continue
        if st.st_uid == os.getuid() and time.time() - st.st_mtime >= min_age_s:
            candidates.append((path, st.st_ino))
    mapped = mapped_inodes(proc) if candidates else None
    if mapped is None:
        return 0
    removed = 0
    for path, inode in candidates:
        if inode in mapped:
            continue
        try:
            path.unlink()
            removed += 1
        except OSError:  # gone meanwhile, or not ours to remove
            continue
    return removed

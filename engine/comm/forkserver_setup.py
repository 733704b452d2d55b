"""The forkserver's own set-up, preloaded by it (engine/comm/dist.py FORKSERVER_PRELOAD) and acting
only there: the forkserver ignores SIGTERM, and every process forked from it starts with SIGTERM's
default again (a rank then ignores it itself, a pool worker keeps it).

Why: the forkserver sits in its launcher's process group, and a group SIGTERM (`timeout`, systemd,
Kubernetes) asks the launcher to drain. multiprocessing reads a forked rank's exit status from the
forkserver, so a forkserver ended by that signal would make every rank of the draining launcher look
dead (exit code 255).
"""
from __future__ import annotations

import os
import signal
import sys
from multiprocessing import forkserver


def _imported_by_the_forkserver() -> bool:
    """Whether this import runs inside `multiprocessing.forkserver.main` (its preloading)."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is forkserver.main.__code__:
            return True
        frame = frame.f_back
    return False


def _sigterm_default() -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


if _imported_by_the_forkserver():
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    os.register_at_fork(after_in_child=_sigterm_default)

"""Progress of a long job: a tqdm bar (rate, ETA, running figures) when stderr is a terminal, the
job's plain log lines otherwise.

Logs, pipes and tests see exactly the lines the job printed before bars existed; a terminal sees one
bar per job instead of a scroll of lines. `Progress.line` is a line that only plain mode prints (the
bar carries the same figures); `Progress.write` is a line that both modes print (above the bar).
"""
from __future__ import annotations

import sys
from collections.abc import Callable
from typing import IO


def is_terminal(stream: IO[str] | None = None) -> bool:
    """True when `stream` (default stderr) is an interactive terminal."""
    stream = sys.stderr if stream is None else stream
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # closed or replaced streams
        return False


class Progress:
    """A bar over `total` units on a terminal; plain lines through `log` otherwise.

    `tty` forces the mode (None: stderr decides); `enabled=False` shows nothing in either mode
    (the ranks of a data-parallel run other than the main one).
    """

    def __init__(self, total: int | None, desc: str, log: Callable[[str], object], unit: str = "it",
                 initial: int = 0, tty: bool | None = None, enabled: bool = True,
                 stream: IO[str] | None = None, unit_scale: bool = False) -> None:
        self.log, self.enabled = log, enabled
        self.bar = None
        if enabled and (is_terminal(stream) if tty is None else tty):
            from tqdm import tqdm

            # dynamic_ncols: the bar follows the terminal's width; mininterval keeps redraws cheap
            self.bar = tqdm(total=total, desc=desc, unit=unit, initial=initial, file=stream or sys.stderr,
                            dynamic_ncols=True, mininterval=0.2, unit_scale=unit_scale)

    @property
    def is_bar(self) -> bool:
        return self.bar is not None

    def update(self, n: int = 1, postfix: str | None = None) -> None:
        """Advance by `n` units; `postfix` (e.g. "loss 2.31 alpha 0.52") shows after the rate."""
        if self.bar is None:
            return
        if postfix is not None:
            self.bar.set_postfix_str(postfix, refresh=False)
        self.bar.update(n)

    def line(self, msg: str) -> None:
        """A per-step line: printed in plain mode only (the bar shows its figures)."""
        if self.enabled and self.bar is None:
            self.log(msg)

    def write(self, msg: str) -> None:
        """A line both modes print; above the bar on a terminal, so the bar is not torn."""
        if not self.enabled:
            return
        if self.bar is None:
            self.log(msg)
        else:
            self.bar.write(msg, file=self.bar.fp)

    def close(self) -> None:
        if self.bar is not None:
            if self.bar.total is not None and self.bar.n > self.bar.total:  # a limit overshot by its last item
                self.bar.total = self.bar.n
                self.bar.refresh()
            self.bar.close()
            self.bar = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

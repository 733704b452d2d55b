"""The co-located driver's stage 0 on a thread of its own, so that its decode step runs while the
driver drafts and verifies (docs/design.md 3.3, "co-located").

Within a decode tick with n >= 2 the driver's PDM rows, draft and verification need nothing of
stage 0's step of the same tick: the rows read anchors produced last tick and the entering
token's embedding, the verification reads the last stage's exit. So the driver posts the token,
lets this runner step stage 0, and joins it at the end of the tick, before the next token is
posted (stage 0 then has that token's anchors ready for the next tick's rows). With n = 1
stage 0 is the last stage and its exit is this tick's verification: nothing to overlap.

On a CPU the torch kernels release the GIL, so the two threads run on two cores when the host
has them. On CUDA the thread steps stage 0 on its own stream and the join synchronises that
stream, so whatever stage 0 left for the driver is complete. The CUDA path has not run yet.
"""
from __future__ import annotations

import threading
from collections.abc import Callable

import torch


class Stage0Runner:
    """One worker thread that runs `step()` when started and reports when joined."""

    def __init__(self, step: Callable[[], None], device: torch.device) -> None:
        self._step = step
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._go, self._done = threading.Event(), threading.Event()
        self._error: BaseException | None = None
        self._busy = self._closed = False
        self._thread = threading.Thread(target=self._loop, name="spd-stage0", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            self._go.wait()
            self._go.clear()
            if self._closed:
                return
            try:
                if self._stream is not None:
                    with torch.cuda.stream(self._stream):
                        self._step()
                else:
                    self._step()
            except BaseException as err:  # noqa: BLE001  handed to the driver's thread at join
                self._error = err
            self._done.set()

    def start(self) -> None:
        assert not self._busy, "stage 0 is still stepping: join before the next start"
        self._busy = True
        self._done.clear()
        self._go.set()

    def join(self) -> None:
        """Wait for the step; re-raise its error in the driver's thread."""
        if not self._busy:
            return
        self._done.wait()
        self._busy = False
        if self._stream is not None:
            self._stream.synchronize()  # host sync: stage 0's outputs are complete before use
        err, self._error = self._error, None
        if err is not None:
            raise err

    def close(self) -> None:
        self.join()
        self._closed = True
        self._go.set()
        self._thread.join(5.0)

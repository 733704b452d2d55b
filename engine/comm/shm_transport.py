"""Shared-memory transport: the runtime's messages between CPU ranks of one host, without gloo.

On a CPU host gloo moves a message through its own I/O thread on each side and wakes the
receiver with a condition variable: a computing rank pays for that in its own thread (posting
sends and receives) and in wake-ups (docs/results/tick-cost-2core.md). Here each
directed rank pair has a byte ring in shared memory with one writer and one reader; a message
is its header ints followed by its payload bytes, copied straight in and out of the ring, so a
send is a copy and a store, and a receive whose data is there is a copy. The same design as
vLLM's shared-memory message queue for ranks on one node (a ring plus polling with
`sched_yield`).

- Ordering: the writer publishes its byte count only after copying the bytes, the reader its own
  only after copying them out; both counters are aligned 8-byte stores, which x86-64's total
  store order keeps in program order, so no fence is needed (other CPUs use gloo: `shm_usable`).
- Waiting: a receive polls, yielding the core for the first `SPIN_S` of a wait (`SHARED_SPIN_S`
  when the ranks' threads outnumber the cores), then sleeps with a growing pause (`MAX_PAUSE_S`
  inside a request, `IDLE_PAUSE_S` between requests), so ranks that outnumber the cores still
  get them.
- Large payloads stream through the ring in pieces; what does not fit yet is kept (copied) and
  written while the rank waits or flushes, so two ranks sending to each other never deadlock.
- Failure: a receive inside a request times out with the same TransportError as the gloo
  transport; a peer that exited (or was killed) or that abandoned its transport ends a wait at
  once with an error naming it (its pid is checked every `ALIVE_CHECK_S` of waiting).
- Set-up is collective over the default process group: rank 0 names the run's segments, every
  rank creates its inbound rings, maps its outbound ones, and the files are unlinked before the
  first message, so nothing is left in /dev/shm even when a rank is killed.
"""
from __future__ import annotations

import mmap
import os
import platform
import secrets
import socket
import struct
import time
import zlib
from collections import deque
from collections.abc import Sequence

import numpy as np
import torch

from spd_engine.engine.comm.transport import Transport, TransportError
from spd_engine.engine.protocol.messages import HEADER_LEN, Header

SHM_DIR = "/dev/shm"
RING_BYTES = 256 * 1024  # per directed link: a decode tick's message is a few KB, a prefill chunk streams
CTRL_BYTES = 192  # written count, read count, closed flag: one 64-byte cache line each
_W, _R, _CLOSED = 0, 8, 16  # int64 indices of the three control words
SPIN_S = 5e-3  # yield-polling at the start of a wait when every rank's threads have a core
SHARED_SPIN_S = 2e-4  # ... and when ranks share cores (a spinning rank would slow a computing one)
MAX_PAUSE_S = 2e-4
IDLE_PAUSE_S = 1e-3  # an idle stage still wakes within 1 ms for the next request (1% of a core on a Xeon, 6% on an EPYC)
ALIVE_CHECK_S = 0.02
_HDR = struct.Struct(f"<{HEADER_LEN}q")  # a header's ints as they lie in the ring (published after)


def shm_usable(world_size: int) -> str | None:
    """None if this host can carry `world_size` ranks' rings, else why not."""
    if platform.system() != "Linux" or platform.machine().lower() not in ("x86_64", "amd64"):
        return f"needs Linux on x86-64 (this is {platform.system()} on {platform.machine()})"
    if not os.path.isdir(SHM_DIR):
        return f"{SHM_DIR} is missing"
    st = os.statvfs(SHM_DIR)
    need = world_size * (world_size - 1) * (RING_BYTES + CTRL_BYTES)
    if st.f_bavail * st.f_frsize < 2 * need:
        return f"{SHM_DIR} has {st.f_bavail * st.f_frsize} bytes free, {2 * need} wanted"
    return None


class _Ring:
    """One direction of one rank pair: RING_BYTES of data after the control words."""

    def __init__(self, path: str, create: bool) -> None:
        size = CTRL_BYTES + RING_BYTES
        fd = os.open(path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0), 0o600)
        try:
            if create:
                os.posix_fallocate(fd, 0, size)  # a full /dev/shm fails here, not with SIGBUS later
            self.mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.ctrl = np.frombuffer(self.mm, dtype=np.int64, count=CTRL_BYTES // 8)
        self.data = np.frombuffer(self.mm, dtype=np.uint8, offset=CTRL_BYTES)
        self.buf = memoryview(self.mm)  # the same bytes for the struct and memoryview fast path
        # the control words as native int64: an item read or write is one aligned 8-byte load or
        # store (a memcpy of 8), as numpy's are; struct's standard-size "<q" may go byte by byte,
        # and a peer could then see half a count
        self.ctl = self.buf[:CTRL_BYTES].cast("q")

    # The fast path of a decode tick's message: a whole message that fits without wrapping is
    # written or read with struct and memoryview copies only. Right after a compute has streamed a
    # stage's weights through the caches, every numpy or torch call on the way costs tens of
    # microseconds; these few C calls cost a few (docs/results/tick-cost-2core.md, "Cold caches").
    def write_message(self, ints: Sequence[int], views: Sequence[memoryview]) -> bool:
        """The header ints, then the payload bytes, published with one count; False (nothing
        written) when the message would wrap around the ring's end or does not fit yet."""
        ctl = self.ctl
        w = ctl[_W]
        at = w % RING_BYTES
        size = _HDR.size
        for v in views:
            size += v.nbytes
        if at + size > RING_BYTES or size > RING_BYTES - (w - ctl[_R]):
            return False
        o = CTRL_BYTES + at
        _HDR.pack_into(self.mm, o, *ints)
        o += _HDR.size
        for v in views:
            self.buf[o:o + v.nbytes] = v
            o += v.nbytes
        ctl[_W] = w + size  # published after the bytes (x86-64 keeps stores in order)
        return True

    def read_header(self) -> tuple[int, ...] | None:
        """The next header's ints, if all of it is there and does not wrap; else None (nothing read)."""
        ctl = self.ctl
        r = ctl[_R]
        at = r % RING_BYTES
        if at + _HDR.size > RING_BYTES or ctl[_W] - r < _HDR.size:
            return None
        ints = _HDR.unpack_from(self.mm, CTRL_BYTES + at)
        ctl[_R] = r + _HDR.size  # the space is free only after the read
        return ints

    def read_view(self, dst: memoryview) -> bool:
        """Fill `dst` (bytes) if all of it is there and does not wrap; else False (nothing read)."""
        ctl = self.ctl
        r = ctl[_R]
        at = r % RING_BYTES
        n = dst.nbytes
        if at + n > RING_BYTES or ctl[_W] - r < n:
            return False
        dst[:] = self.buf[CTRL_BYTES + at:CTRL_BYTES + at + n]
        ctl[_R] = r + n
        return True

    def available(self) -> int:
        """Bytes written and not yet read."""
        return self.ctl[_W] - self.ctl[_R]

    def write_some(self, src: np.ndarray) -> int:
        """Copy as much of `src` (uint8) as fits; the bytes written."""
        w = int(self.ctrl[_W])
        k = self._copy_in(src, w, RING_BYTES - (w - int(self.ctrl[_R])))
        self.ctrl[_W] = w + k  # published after the bytes (x86-64 keeps stores in order)
        return k

    def write_parts(self, parts: list[np.ndarray]) -> list[np.ndarray]:
        """Copy the parts (uint8) in order as far as they fit, publishing the count once (a
        decode message's header and payloads: one store for the whole message); what did not fit."""
        w = w0 = int(self.ctrl[_W])
        free = RING_BYTES - (w - int(self.ctrl[_R]))
        for i, part in enumerate(parts):
            k = self._copy_in(part, w, free - (w - w0))
            w += k
            if k < part.size:
                self.ctrl[_W] = w
                return [part[k:]] + parts[i + 1:]
        self.ctrl[_W] = w
        return []

    def _copy_in(self, src: np.ndarray, w: int, free: int) -> int:
        """Copy up to `free` bytes of `src` to the ring at count `w` (not published); the bytes copied."""
        k = min(free, src.size)
        at = w % RING_BYTES
        first = min(k, RING_BYTES - at)
        self.data[at:at + first] = src[:first]
        if k > first:
            self.data[:k - first] = src[first:k]
        return k

    def read_some(self, dst: np.ndarray) -> int:
        """Copy up to dst.size available bytes into `dst`; the bytes read."""
        w, r = int(self.ctrl[_W]), int(self.ctrl[_R])
        k = min(w - r, dst.size)
        at = r % RING_BYTES
        first = min(k, RING_BYTES - at)
        dst[:first] = self.data[at:at + first]
        if k > first:
            dst[first:k] = self.data[:k - first]
        self.ctrl[_R] = r + k  # the space is free only after the copy
        return k


def _alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie, an exited child not yet reaped, counts as dead)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state not in (b"Z", b"X")


class _Wait:
    """When a wait began and when it next checks that its peers live."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.next_check = self.start + ALIVE_CHECK_S


def _as_bytes(t: torch.Tensor) -> np.ndarray:
    """A CPU tensor's bytes as a flat uint8 array (a view when it is contiguous)."""
    if t.dtype in _NUMPY_DTYPES and not t.requires_grad and t.is_contiguous():
        return t.numpy().reshape(-1).view(np.uint8)  # one torch call: the per-message fast path
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()


# dtypes numpy holds (bfloat16 is not one of them: it goes through torch's uint8 view)
_NUMPY_DTYPES = frozenset((torch.float32, torch.float64, torch.float16, torch.int64, torch.int32, torch.uint8))


class ShmTransport(Transport):
    """The Transport interface over shared-memory rings; CPU tensors only. Collective: every rank
    of the default process group constructs it at the same point."""

    pins_buffers = True

    def __init__(self, rank: int, world_size: int) -> None:
        import torch.distributed as dist

        why = shm_usable(world_size)
        if why is not None:
            raise ValueError(f"shared-memory transport unavailable: {why}")
        self.rank, self.world_size = rank, world_size
        crowded = world_size * torch.get_num_threads() > len(os.sched_getaffinity(0))
        self.spin_s = SHARED_SPIN_S if crowded else SPIN_S
        ids = torch.zeros(2 * world_size, dtype=torch.int64)  # [pid of each rank, run name (rank 0)]
        ids[rank] = os.getpid()
        if rank == 0:
            ids[world_size] = secrets.randbits(62)
        dist.all_reduce(ids)
        host = torch.tensor([zlib.crc32(socket.gethostname().encode())] * 2, dtype=torch.int64)
        host[1] = -host[1]
        dist.all_reduce(host, op=dist.ReduceOp.MAX)
        if host[0] != -host[1]:
            raise ValueError("shared-memory transport: the ranks run on more than one host (use --transport gloo)")
        self.pids = ids[:world_size].tolist()
        name = f"{SHM_DIR}/spd-{int(ids[world_size]):x}"
        peers = [p for p in range(world_size) if p != rank]
        self._in = {src: _Ring(f"{name}-{src}-{rank}", create=True) for src in peers}
        dist.barrier()
        self._out = {dst: _Ring(f"{name}-{rank}-{dst}", create=False) for dst in peers}
        dist.barrier()
        for src in peers:
            os.unlink(f"{name}-{src}-{rank}")
        self._queued: dict[int, deque[np.ndarray]] = {dst: deque() for dst in peers}  # bytes not yet in the ring
        self._head = np.zeros(HEADER_LEN, dtype=np.int64)  # the receive buffer of a header
        self._views: dict[int, memoryview] = {}  # id(pinned tensor) -> its bytes
        self._pinned: list[torch.Tensor] = []  # keeps them alive, so their ids are not reused

    def pin(self, t: torch.Tensor) -> None:
        assert t.device.type == "cpu" and t.is_contiguous(), "shared-memory rings carry contiguous CPU tensors"
        if id(t) not in self._views:
            self._views[id(t)] = memoryview(_as_bytes(t))
            self._pinned.append(t)

    def _view(self, t: torch.Tensor) -> memoryview:
        v = self._views.get(id(t))
        return v if v is not None else memoryview(_as_bytes(t))

    # ---- sending ----
    def send(self, dst: int, header: Header, payloads: Sequence[torch.Tensor] = ()) -> None:
        queued = self._queued[dst]
        views = [self._view(p) for p in payloads]
        if not queued and self._out[dst].write_message(header, views):
            return
        head = np.array(header.to_ints(), dtype=np.int64).view(np.uint8)
        parts = [head] + [np.frombuffer(v, np.uint8) for v in views]
        if not queued:
            parts = self._out[dst].write_parts(parts)
        for part in parts:
            if part.size:
                queued.append(part.copy())  # the caller may reuse its buffer after this call

    def _pump(self) -> bool:
        """Write queued bytes that now fit; True if any remain."""
        left = False
        for dst, queued in self._queued.items():
            ring = self._out[dst]
            while queued:
                head = queued[0]
                k = ring.write_some(head)
                if k < head.size:
                    queued[0] = head[k:]
                    left = True
                    break
                queued.popleft()
        return left

    def flush(self) -> None:
        wait = _Wait()
        while self._pump():
            self._pause(wait, None, -1, -1)

    # ---- receiving ----
    def recv_header(self, src: int, timeout: float | None, tick: int = -1) -> Header:
        ints = self._in[src].read_header()
        if ints is None:  # not there yet, or it wraps: the general path
            self._read(src, self._head.view(np.uint8), timeout, tick)
            ints = self._head.tolist()
        return Header.from_ints(ints)

    def ready(self, src: int) -> bool:
        # reads stop at message boundaries, so a header's bytes come first
        return self._in[src].available() >= _HDR.size

    def recv_into(self, src: int, out: torch.Tensor, timeout: float | None, tick: int = -1) -> torch.Tensor:
        v = self._views.get(id(out))
        if v is not None and self._in[src].read_view(v):
            return out
        assert out.is_contiguous() and out.device.type == "cpu", "shared-memory rings carry CPU tensors"
        self._read(src, _as_bytes(out), timeout, tick)  # a view: contiguous
        return out

    def _read(self, src: int, dst: np.ndarray, timeout: float | None, tick: int) -> None:
        ring, got, wait = self._in[src], 0, None
        while True:
            got += ring.read_some(dst[got:])
            if got == dst.size:
                return
            wait = wait or _Wait()
            self._pump()  # a rank that waits still moves what it owes its peers
            self._pause(wait, timeout, src, tick)

    def _pause(self, wait: "_Wait", timeout: float | None, src: int, tick: int) -> None:
        """One poll interval of a wait; raises when the wait must end (timeout, dead peer)."""
        now = time.perf_counter()
        waited = now - wait.start
        if waited < self.spin_s:
            os.sched_yield()
            return
        if timeout is not None and waited > timeout:
            raise TransportError(self.rank, src, tick, f"receive timed out after {timeout}s")
        if now >= wait.next_check:
            wait.next_check = now + ALIVE_CHECK_S
            self._check_peers(src, tick)
        time.sleep(min(IDLE_PAUSE_S if timeout is None else MAX_PAUSE_S, waited / 4))

    def _check_peers(self, src: int, tick: int) -> None:
        peers = [src] if src >= 0 else list(self._out)
        for p in peers:
            if not _alive(self.pids[p]):
                raise TransportError(self.rank, p, tick, f"peer failed: rank {p} (pid {self.pids[p]}) has exited")
            if self._in[p].ctrl[_CLOSED] or self._out[p].ctrl[_CLOSED]:
                raise TransportError(self.rank, p, tick, f"peer failed: rank {p} abandoned the run")

    def abandon(self) -> None:
        """The run is failing here: tell every peer at once (their waits end with an error)."""
        for ring in (*self._in.values(), *self._out.values()):
            ring.ctrl[_CLOSED] = 1
        for queued in self._queued.values():
            queued.clear()

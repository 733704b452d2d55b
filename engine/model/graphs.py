"""CUDA-graph capture of the per-tick decode steps: a stage's one-token step, the driver's PDM
step and verification (final norm + LM head + argmax), with an eager fallback.

A graph replays fixed kernels on fixed buffers, so nothing that changes from step to step may
pass through the host: the position lives in a device tensor. Two things depend on it:
- the KV write slot: `index_copy_` at the position tensor (`DevicePositionCache`);
- the attention length: attention runs over a fixed-length prefix of the static KV cache (a
  *length bucket*) with the mask `slot <= position` computed on the device from the position
  tensor. One graph per bucket (powers of two up to the capacity), picked by the host from the
  position it already knows (every message header carries it), keeps the wasted attention
  below 2x of the live length. The runtime captures every bucket when a rank starts (`prepare`).
Slots above the position may hold entries of a flushed token (docs/design.md 3.4); the mask hides
them exactly as the eager path's shorter cache view does. The masked step reproduces the
eager path (`StageModel.forward_layers` with an int slot) up to floating-point summation
order in attention: tests check fp32 agreement within 1e-5 and equal argmax tokens.

Graphs are captured only on CUDA and only when asked; anywhere else the same static step runs
eagerly, so the code path is testable on CPU. Capture failures fall back to eager and are
reported by `StepGraph.mode`.
"""
from __future__ import annotations

import threading
from collections.abc import Callable

import torch

from spd_engine.engine.model.kv_cache import KVCache
from spd_engine.engine.model.model import StageModel
from spd_engine.engine.model.pdm import PDM


def length_buckets(capacity: int, smallest: int = 128) -> tuple[int, ...]:
    """Attention lengths with a graph each: smallest, 2x, 4x, ... and finally the capacity."""
    if capacity < 1 or smallest < 1:
        raise ValueError(f"capacity and smallest bucket must be positive, got {capacity}, {smallest}")
    out, b = [], smallest
    while b < capacity:
        out.append(b)
        b *= 2
    out.append(capacity)
    return tuple(out)


def bucket_for(buckets: tuple[int, ...], end: int) -> int:
    """The shortest bucket holding slots [0, end)."""
    for b in buckets:
        if end <= b:
            return b
    raise ValueError(f"position range up to {end} exceeds the KV capacity {buckets[-1]}")


class DevicePositionCache:
    """A KVCache view whose writes go to the slots held in a device tensor; reads return the
    first `length` slots. Passed to `StageModel.forward_layers` in place of the cache."""

    def __init__(self, cache: KVCache, slots: torch.Tensor, length: int) -> None:
        assert length <= cache.capacity, (length, cache.capacity)
        self.cache, self.slots, self.length = cache, slots, length
        self.capacity = cache.capacity

    def write(self, layer: int, slot0: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v [B, nkv, T, hd] go to slots `self.slots` [T] (slot0 is ignored: the host does not
        know the position inside a graph); returns the bucket view [B, nkv, length, hd]."""
        kc, vc = self.cache.k[layer], self.cache.v[layer]
        kc.index_copy_(2, self.slots, k)
        vc.index_copy_(2, self.slots, v)
        return kc[:, :, :self.length], vc[:, :, :self.length]


def position_mask(slots: torch.Tensor, length: int) -> torch.Tensor:
    """Bool [1, 1, T, length]: row i sees the slots <= slots[i] (causal, stale slots hidden)."""
    cols = torch.arange(length, device=slots.device)
    return (cols[None, :] <= slots[:, None])[None, None]


def static_forward(model: StageModel, h: torch.Tensor, cache: KVCache, slots: torch.Tensor, length: int,
                   capture: frozenset[int] = frozenset()) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """`model.forward_layers` on h [1, T, H] at the positions in `slots` [T] (a device tensor),
    attending over the first `length` cache slots with a device-side mask. Host-sync free."""
    view = DevicePositionCache(cache, slots, length)
    return model.forward_layers(h, view, 0, positions=slots[None], mask=position_mask(slots, length),
                                capture=capture)


_CAPTURE_LOCK = threading.Lock()  # process-wide: CUDA graph capture is not thread-safe


class StepGraph:
    """fn() -> outputs that live in static buffers. On CUDA with `enabled`, fn is captured once
    as a CUDA graph and `__call__` replays it; otherwise `__call__` runs fn eagerly."""

    def __init__(self, fn: Callable[[], object], device: torch.device, enabled: bool = True, warmup: int = 3) -> None:
        self.fn, self.device, self.graph, self.out = fn, device, None, None
        if not enabled:
            self.mode = "eager (graphs disabled)"
        elif device.type != "cuda":
            self.mode = f"eager (graphs skipped on {device.type})"
        else:
            try:
                self._capture(warmup)
                self.mode = "cuda graph"
            except RuntimeError as err:  # e.g. an op that syncs the host: run eagerly instead
                self.graph = None
                self.mode = f"eager (capture failed: {str(err).splitlines()[0][:160]})"

    @torch.no_grad()  # inference only: no autograd state inside the graph
    def _capture(self, warmup: int) -> None:
        # One capture at a time per process (the reference executor runs stages as threads, each
        # capturing lazily), on this graph's device and its own capture stream; thread-local
        # capture mode leaves other threads' work on other streams alone.
        with _CAPTURE_LOCK, torch.cuda.device(self.device):
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up off the capture stream (lazy inits, autotuning)
                for _ in range(warmup):
                    self.fn()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=torch.cuda.Stream(), capture_error_mode="thread_local"):
                self.out = self.fn()
            self.graph = graph

    @property
    def graphed(self) -> bool:
        return self.graph is not None

    def __call__(self):
        if self.graph is None:
            return self.fn()
        with torch.cuda.device(self.device):  # replay goes to the current device's current stream
            self.graph.replay()
        return self.out


class _Bucketed:
    """Shared machinery: a static position tensor and one StepGraph per length bucket."""

    def __init__(self, device: torch.device, capacity: int, rows: int, graphs: bool,
                 buckets: tuple[int, ...] | None) -> None:
        self.device, self.capacity, self.rows, self.use_graphs = device, capacity, rows, graphs
        self.buckets = buckets or length_buckets(capacity)
        assert self.buckets[-1] <= capacity, (self.buckets, capacity)
        self.pos = torch.zeros(1, dtype=torch.long, device=device)  # [1] first slot of this step
        self.offsets = torch.arange(rows, device=device)  # [rows]
        self.graphs: dict[int, StepGraph] = {}

    def _graph(self, pos: int) -> StepGraph:
        """Set the position, then the bucket's graph (captured on first use: its warm-up runs
        write this step's own K/V slots with this step's inputs, so they are harmless)."""
        if pos < 0:
            raise ValueError(f"position must be >= 0, got {pos}")
        length = bucket_for(self.buckets, pos + self.rows)
        self.pos.fill_(pos)  # a kernel with a scalar argument: no host sync
        if length not in self.graphs:
            self.graphs[length] = StepGraph(self._step_fn(length), self.device, self.use_graphs)
        return self.graphs[length]

    @torch.no_grad()
    def prepare(self) -> dict[int, str]:
        """Build (on CUDA: capture) every bucket's step now, so that no capture lands inside a
        timed request. The warm-up runs write K/V at each bucket's last slots from whatever the
        input buffers hold, which is harmless: a slot is read only by positions after it, and
        those come after the real token of that slot has written it (rollback is lazy the same way)."""
        for length in self.buckets:
            if length >= self.rows:
                self._graph(length - self.rows)
        return self.modes()

    def _slots(self) -> torch.Tensor:
        return self.pos + self.offsets  # [rows]

    def _step_fn(self, length: int) -> Callable[[], object]:
        raise NotImplementedError

    def modes(self) -> dict[int, str]:
        return {length: g.mode for length, g in sorted(self.graphs.items())}


class StageStep(_Bucketed):
    """A stage's one-token decode step on static buffers: the token id [1, 1] (a stage with the
    embedding) or the hidden state [1, 1, H] comes in; the output hidden state [1, 1, H], the
    captured anchor states and, with `head` (default: the model's), the argmax token id [1] come out."""

    def __init__(self, model: StageModel, cache: KVCache, graphs: bool = True, buckets: tuple[int, ...] | None = None,
                 capture: frozenset[int] = frozenset(), head: bool | None = None) -> None:
        p = next(model.parameters())
        super().__init__(p.device, cache.capacity, 1, graphs, buckets)
        self.model, self.cache, self.capture = model, cache, capture
        self.head = model.has_head if head is None else head
        assert model.has_head or not self.head
        self.h_in = torch.zeros(1, 1, model.cfg.hidden_size, device=p.device, dtype=p.dtype)  # [1, 1, H]
        self.tok_in = torch.zeros(1, 1, dtype=torch.long, device=p.device)  # [1, 1]

    def _step_fn(self, length: int):
        def step():
            h = self.model.embed(self.tok_in) if self.model.has_embedding else self.h_in
            out, caps = static_forward(self.model, h, self.cache, self._slots(), length, self.capture)
            token = self.model.logits(out[0, -1]).argmax().view(1) if self.head else None
            return out, caps, token
        return step

    @torch.no_grad()
    def run(self, pos: int, h: torch.Tensor | None = None, token: int | torch.Tensor | None = None):
        """(hidden [1, 1, H], anchors {layer: [1, 1, H]}, token [1] or None) for the token at `pos`.
        The outputs are static buffers, overwritten by the next step of the same bucket."""
        if self.model.has_embedding:
            assert token is not None, "a stage with the embedding takes a token id"
            if isinstance(token, int):
                self.tok_in.fill_(token)
            else:
                self.tok_in.copy_(token.view(1, 1))
        else:
            assert h is not None, "a stage without the embedding takes a hidden state"
            self.h_in.copy_(h.view(1, 1, -1))
        return self._graph(pos)()


class PDMStep(_Bucketed):
    """The driver's PDM step on static buffers: rows [1, R, H] at positions pos .. pos+R-1 go
    through the K decoder layers (own KV cache); the last row's hidden state [H] and the draft
    head's argmax on it, as a target token id [1], come out on the device (no host sync inside)."""

    def __init__(self, pdm: PDM, cache: KVCache, rows: int, graphs: bool = True,
                 buckets: tuple[int, ...] | None = None) -> None:
        p = next(pdm.parameters())
        super().__init__(p.device, cache.capacity, rows, graphs, buckets)
        self.pdm, self.cache = pdm, cache
        self.rows_in = torch.zeros(1, rows, pdm.target_cfg.hidden_size, device=p.device,
                                   dtype=pdm.compute_dtype)  # [1, R, H]

    def _step_fn(self, length: int):
        def step():
            h, _ = static_forward(self.pdm.stack, self.rows_in, self.cache, self._slots(), length)
            last = h[0, -1]  # [H]
            best = self.pdm.draft_logits(last).argmax().view(1)  # [1] draft-vocabulary index
            return last, self.pdm.draft_ids.index_select(0, best)  # [1] target id (a 0-d index would sync)
        return step

    @torch.no_grad()
    def run(self, pos: int, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """rows [R, H] or [1, R, H] at slots [pos, pos + R) -> (last hidden [H], greedy draft id [1]),
        both static device buffers."""
        self.rows_in.copy_(rows.view(1, self.rows, -1))
        return self._graph(pos)()


class VerifyStep:
    """Verification's device work at T=0: final norm + LM head + argmax on a static [H] input."""

    def __init__(self, head: StageModel, graphs: bool = True) -> None:
        assert head.has_head
        p = next(head.parameters())
        self.head = head
        self.h_in = torch.zeros(head.cfg.hidden_size, device=p.device, dtype=p.dtype)  # [H]
        self.graph = StepGraph(lambda: self.head.logits(self.h_in).argmax(), p.device, graphs)

    @property
    def mode(self) -> str:
        return self.graph.mode

    @torch.no_grad()
    def run(self, h: torch.Tensor) -> torch.Tensor:
        """h [H] -> argmax token id [] (device)."""
        self.h_in.copy_(h.view(-1))
        return self.graph()

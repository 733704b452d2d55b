"""Batch invariance: a row's result of a matmul whatever the other rows of its step.

A step over several requests multiplies all their rows by every weight at once (docs/design.md
3.12). A BLAS picks its kernel by the number of rows: MKL multiplies one row by a row- or
column-major fp32 weight with a matrix-vector kernel and two or more with a matrix-matrix one,
and the two sum in another order, so a request's row rounds differently alone than beside
another's, a different draft comes out and, at T > 0, rejection sampling takes another path. On
the hosts measured a row's bits are the same for every row count from a small floor on (2 for
SmolLM2's row- and column-major weights, 4 for its row-major attention ones with two threads) up to a
ceiling (MKL's row-major product takes a third kernel from 16 rows on), and zero rows added to a
step leave the other rows' bits alone. So a linear whose kernel needs it gets its steps of fewer
rows than its floor padded with zero rows (`RowPaddedLinear`): every row count up to the ceiling
then computes each row as the floor's block does.

Which linears need it, their floors and ceilings, is not assumed: `probe_rows` runs the module
itself on 1 .. PROBE_ROWS random rows when the model is built, where the rank's weights, layout
and intra-op threads are in place (a rank sets its threads first; a model run under another
thread count keeps the floors of the one it was built under), and takes the floor (up to
MAX_FLOOR) under which the most row counts agree. The model keeps the least ceiling
(`Invariance.max_rows`): a step of more rows may round a row otherwise, as may a GPU BLAS, which
tiles other row counts otherwise (there the probe finds the ceiling). oneDNN's packed layout
pads to 4 itself and int8 rows needed no floor on the hosts measured (both are probed, and named
in `Invariance.variant` where they would need one); the mixed layout is not invariant (one row
takes its column-major copy, several the packed weight); the LM head keeps one row per product
instead (StageModel.logits_rows).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from spd_engine.kernels.packed_linear import PackedLinear

PROBE_ROWS = 16  # a batch of 8 requests at branch width 2, or 16 one-row entries
MAX_FLOOR = 4  # a larger floor would cost a lone request's one-row steps several rows each
RowFn = Callable[[torch.Tensor], torch.Tensor]  # rows [M, K] -> [M, N]


def pad_rows(x2: torch.Tensor, floor: int) -> torch.Tensor:
    """x2 [M, K] -> [max(M, floor), K]: zero rows added below."""
    m = x2.shape[0]
    return x2 if m >= floor else F.pad(x2, (0, 0, 0, floor - m))


@torch.no_grad()
def probe_rows(fn: RowFn, in_features: int, dtype: torch.dtype, device: torch.device | str,
               seed: int = 0) -> tuple[int, int]:
    """(floor, ceiling): with steps of fewer than `floor` rows padded with zero rows to it, `fn` gives
    each row the same bits in every step of 1 .. `ceiling` rows (random rows, up to PROBE_ROWS). The
    floor (up to MAX_FLOOR) with the highest ceiling, the lowest of those."""
    x = torch.randn(PROBE_ROWS, in_features, generator=torch.Generator().manual_seed(seed)).to(device, dtype)
    outs = {m: fn(x[:m]) for m in range(1, PROBE_ROWS + 1)}  # outs[m]: m rows, unpadded
    best = (1, 1)
    for floor in range(1, MAX_FLOOR + 1):
        ceiling = next(c for c in range(PROBE_ROWS, floor - 1, -1)
                       if all(torch.equal(outs[m], outs[c][:m]) for m in range(floor, c)))
        if ceiling > best[1] and all(torch.equal(fn(pad_rows(x[:m], floor))[:m], outs[floor][:m])
                                     for m in range(1, floor)):
            best = (floor, ceiling)
    return best


class RowPaddedLinear(nn.Linear):
    """An nn.Linear whose steps of fewer than `row_floor` rows are padded with zero rows (the
    class an nn.Linear is switched to in place: parameters and state-dict names stay)."""

    row_floor: int = 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = x.numel() // x.shape[-1]
        if m >= self.row_floor:
            return F.linear(x, self.weight, self.bias)
        y = F.linear(pad_rows(x.reshape(m, x.shape[-1]), self.row_floor), self.weight, self.bias)  # [floor, N]
        return y[:m].reshape(*x.shape[:-1], self.out_features)


@dataclass
class Invariance:
    """What `make_row_invariant_` did: linears padded to a floor, the most rows per step for which
    every linear's rows are invariant, and the names of those that are not invariant at all."""

    padded: int = 0
    max_rows: int = PROBE_ROWS
    variant: list[str] = field(default_factory=list)

    @property
    def invariant(self) -> bool:
        """Whether steps of up to 2 rows (two requests' one-row entries) are."""
        return not self.variant and self.max_rows >= 2

    def add(self, name: str, floor_ceiling: tuple[int, int]) -> None:
        self.max_rows = min(self.max_rows, floor_ceiling[1])
        if floor_ceiling[1] < 2:
            self.variant.append(name)


def _kernel_key(m: nn.Module) -> tuple:
    """What decides a linear's kernel (not its values): type, shape, strides, dtype, device, threads."""
    w = m.weight if isinstance(m, nn.Linear) else getattr(m, "q", None)
    shape = (m.out_features, m.in_features)
    layout = (tuple(w.stride()), w.dtype, str(w.device)) if w is not None else ()
    bias = getattr(m, "bias", None) is not None
    return type(m).__name__, shape, layout, bias, getattr(m, "kernel", None), torch.get_num_threads()


_FLOORS: dict[tuple, tuple[int, int]] = {}


def linear_rows(m: nn.Module) -> tuple[int, int]:
    """`probe_rows` of a linear module's own forward, once per kernel key (every layer of a model
    shares a few shapes)."""
    key = _kernel_key(m)
    if key not in _FLOORS:
        p = next(iter(m.buffers()), None) if not isinstance(m, nn.Linear) else m.weight
        dtype = torch.float32 if p is None or not p.is_floating_point() else p.dtype
        _FLOORS[key] = probe_rows(m, m.in_features, dtype, p.device if p is not None else "cpu")
    return _FLOORS[key]


@torch.no_grad()
def make_row_invariant_(module: nn.Module, skip: tuple[nn.Module, ...] = ()) -> Invariance:
    """Give every linear inside `module` (but those in `skip`) row-count-invariant results where a
    floor does it: an nn.Linear becomes a RowPaddedLinear with its probed floor; a packed linear
    (its own padding) or int8 rows are probed and reported where they would need one, as is the
    mixed layout's. Call once the layout and the rank's threads are set."""
    out = Invariance()
    for name, m in module.named_modules():
        if any(m is s for s in skip):
            continue
        if isinstance(m, PackedLinear) and m.dense is not None:
            out.variant.append(name)  # mixed: one row through the column-major copy, several packed
            continue
        if not hasattr(m, "in_features") or not hasattr(m, "out_features") or isinstance(m, RowPaddedLinear):
            continue
        floor, ceiling = linear_rows(m)
        if floor > 1 and type(m) is not nn.Linear:
            out.variant.append(name)  # a kernel this module cannot pad (packed pads to 4 itself)
            continue
        out.add(name, (floor, ceiling))
        if floor > 1:
            m.__class__ = RowPaddedLinear
            m.row_floor = floor
            out.padded += 1
    return out

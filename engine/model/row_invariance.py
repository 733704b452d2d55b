"""Batch invariance: a row's result of a matmul whatever the other rows of its step.

A step over several requests multiplies all their rows by every weight at once (docs/design.md
3.12). A BLAS picks its kernel by the number of rows: MKL multiplies one row by a row- or
column-major fp32 weight with a matrix-vector kernel and two or more with a matrix-matrix one,
and the two sum in another order, so a request's row rounds differently alone than beside
another's, a different draft comes out and, at T > 0, rejection sampling takes another path. On
the hosts measured a row's bits are the same for every row count from a small floor on (2 for
most of SmolLM2's weights, up to 4 for a square weight with two threads), and zero rows added to
a step leave the other rows' bits alone. So a linear whose kernel is not row-invariant gets its
steps of fewer rows than its floor padded with zero rows (`RowPaddedLinear`): every row count
then computes each row as the floor's block does.

Which linears need it, and their floors, is not assumed: `probe_floor` runs the module itself on
1 .. PROBE_ROWS random rows at start-up, where the rank's weights, layout and intra-op threads
are in place, and takes the smallest floor from which every row count, padded, gives each row
the bits of the PROBE_ROWS-row step. A kernel without such a floor (none up to MAX_FLOOR
makes it agree, as a GPU BLAS may choose other tiles for other row counts) is left as it is and
reported (`Invariance.variant`): batch invariance does not hold there. Steps of more than
PROBE_ROWS rows are not probed. oneDNN's packed layout is row-invariant by its own probe
(kernels/packed_linear.py) and int8 rows were on the hosts measured; the mixed layout is not
(one row takes its column-major copy, several the packed weight), and the LM head keeps one row
per product instead (StageModel.logits_rows).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from spd_engine.kernels.packed_linear import PackedLinear

PROBE_ROWS = 16  # a batch of 8 requests at branch width 2, or 16 one-row entries
MAX_FLOOR = 8  # a larger floor would cost most steps several times their rows, and leave few counts checked
RowFn = Callable[[torch.Tensor], torch.Tensor]  # rows [M, K] -> [M, N]


def pad_rows(x2: torch.Tensor, floor: int) -> torch.Tensor:
    """x2 [M, K] -> [max(M, floor), K]: zero rows added below."""
    m = x2.shape[0]
    return x2 if m >= floor else F.pad(x2, (0, 0, 0, floor - m))


@torch.no_grad()
def probe_floor(fn: RowFn, in_features: int, dtype: torch.dtype, device: torch.device | str,
                seed: int = 0) -> int | None:
    """The smallest row count f (up to MAX_FLOOR) such that `fn` of any 1 .. PROBE_ROWS - 1 rows, padded
    with zero rows to f, gives each row exactly its bits in the PROBE_ROWS-row step; None where no f does."""
    x = torch.randn(PROBE_ROWS, in_features, generator=torch.Generator().manual_seed(seed)).to(device, dtype)
    full = fn(x)
    alone = [torch.equal(fn(x[:m]), full[:m]) for m in range(1, PROBE_ROWS)]  # alone[m-1]: m rows, unpadded
    for floor in range(1, MAX_FLOOR + 1):
        if not all(alone[floor - 1:]):
            continue
        if all(torch.equal(fn(pad_rows(x[:m], floor))[:m], full[:m]) for m in range(1, floor)):
            return floor
    return None


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
    """What `make_row_invariant_` did: linears padded to a floor, and the names of those it could
    not make row-invariant."""

    padded: int = 0
    variant: list[str] = field(default_factory=list)

    @property
    def invariant(self) -> bool:
        return not self.variant


def _kernel_key(m: nn.Module) -> tuple:
    """What decides a linear's kernel (not its values): type, shape, strides, dtype, device, threads."""
    w = m.weight if isinstance(m, nn.Linear) else getattr(m, "q", None)
    shape = (m.out_features, m.in_features)
    layout = (tuple(w.stride()), w.dtype, str(w.device)) if w is not None else ()
    bias = getattr(m, "bias", None) is not None
    return type(m).__name__, shape, layout, bias, getattr(m, "kernel", None), torch.get_num_threads()


_FLOORS: dict[tuple, int | None] = {}


def linear_floor(m: nn.Module) -> int | None:
    """`probe_floor` of a linear module's own forward, once per kernel key (every layer of a model
    shares a few shapes)."""
    key = _kernel_key(m)
    if key not in _FLOORS:
        p = next(iter(m.buffers()), None) if not isinstance(m, nn.Linear) else m.weight
        dtype = torch.float32 if p is None or not p.is_floating_point() else p.dtype
        _FLOORS[key] = probe_floor(m, m.in_features, dtype, p.device if p is not None else "cpu")
    return _FLOORS[key]


@torch.no_grad()
def make_row_invariant_(module: nn.Module, skip: tuple[nn.Module, ...] = ()) -> Invariance:
    """Give every linear inside `module` (but those in `skip`) row-count-invariant results where a
    floor does it: an nn.Linear becomes a RowPaddedLinear with its probed floor; a packed linear
    keeps its own padding (its `row_invariant` probe) unless it holds the mixed layout's one-row
    copy; any other linear (int8 rows) is probed and reported if not invariant. Call once the
    layout and the rank's threads are set."""
    out = Invariance()
    for name, m in module.named_modules():
        if any(m is s for s in skip):
            continue
        if isinstance(m, PackedLinear):
            if m.dense is not None or not m.row_invariant:
                out.variant.append(name)
            continue
        if not hasattr(m, "in_features") or not hasattr(m, "out_features") or isinstance(m, RowPaddedLinear):
            continue
        floor = linear_floor(m)
        if floor is None or (floor > 1 and type(m) is not nn.Linear):
            out.variant.append(name)  # no floor, or a kernel this module cannot pad
        elif floor > 1:
            m.__class__ = RowPaddedLinear
            m.row_floor = floor
            out.padded += 1
    return out

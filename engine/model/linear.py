"""The engine's linear weights in memory: row-major, column-major, packed (oneDNN) or mixed.

A linear weight is `[out, in]` in every layout (names, shapes, values and checkpoints are
unchanged); column-major stores it over `[in, out]` contiguous memory (`w.t().contiguous().t()`);
packed replaces the nn.Linear by a PackedLinear over oneDNN's blocked weight
(kernels/packed_linear.py; a linear the kernel cannot serve stays an nn.Linear, column-major);
mixed is packed with a column-major copy for one-row steps. A decode step multiplies one or a few
rows by every weight, and on a CPU the kernel that runs it depends on the layout. One stage step
of 15 layers of SmolLM2-135M's shape, fp32, one thread, a 2-core AMD EPYC, by rows in the step
(`spd measure stage-width-time --layers 15 --widths 1,2,4,8 --layouts col,packed,mixed`; row from
`--layouts row,col`; docs/design.md 3.14):

    rows              1      2      4      8
    row-major      21.2   31.6   28.7         ms
    column-major   17.8   24.5   32.3   37.2
    packed         18.7   19.2   18.8   23.5
    mixed          17.5   19.7   19.1   23.7

and with two threads a packed one-row step spreads over both (MKL's one-row kernel stays on one).
So `auto` on a CPU with oneDNN is packed (mixed is a little faster with one thread, but its
one-row step rounds otherwise than its several-row one, so a request's row would round otherwise
alone than in a batch: engine/model/row_invariance.py); col without it; but the fastest kernel
depends on the CPU (on an Intel Xeon packed's one-row step is the
slowest), so where `spd bench` measured the layouts on this device `auto` takes its choice
(engine/runtime/measured_layout.py). Only fp32 weights move (the layouts were compared in fp32
only), and on a GPU `auto` keeps torch's layout.

The layout changes the kernel, hence float rounding: every model whose outputs are compared with
each other (a run's stages, its greedy reference, the replays) is built with the same layout, so a
run resolves it once (`RunConfig.resolved_weight_layout`) and the builders apply it
(engine/runtime/build.py), never a module global.
"""
from __future__ import annotations

import torch
from torch import nn

from spd_engine.kernels.packed_linear import PackedLinear, packed_kernel_available, to_packed_linears_

LAYOUTS = ("row", "col", "packed", "mixed")


def resolve_layout(layout: str, device: str, threads: int = 1, measured: str | None = None) -> str:
    """`auto` -> on a CPU, the layout measured fastest there (`measured`, engine/runtime/
    measured_layout.py; packed for mixed) where there is one, else packed with oneDNN, col without
    it; row elsewhere. Otherwise checked. `threads` is kept for callers: with one thread mixed's
    one-row step is faster, but a row of it rounds otherwise alone than in a batch."""
    if layout == "auto":
        if not device.startswith("cpu"):
            return "row"
        if measured is not None and (measured in ("row", "col") or packed_kernel_available()):
            return "packed" if measured == "mixed" else measured  # mixed is not batch-invariant
        return "packed" if packed_kernel_available() else "col"
    if layout not in LAYOUTS:
        raise ValueError(f"weight layout must be auto or one of {LAYOUTS}, got {layout!r}")
    if layout in ("packed", "mixed") and not device.startswith("cpu"):
        raise ValueError(f"weight layout {layout} is oneDNN's CPU layout; device {device!r} takes row or col")
    return layout


def is_col_major(w: torch.Tensor) -> bool:
    """Whether a 2-D weight `[out, in]` lies over `[in, out]` contiguous memory."""
    return w.dim() == 2 and min(w.shape) > 1 and w.t().is_contiguous()


@torch.no_grad()
def set_weight_layout_(module: nn.Module, layout: str, skip: tuple[nn.Module, ...] = ()) -> int:
    """Store every fp32 `nn.Linear` weight of `module` (but those in `skip`) in `layout`, in place
    (row and col: the Parameter objects stay; packed: the modules are replaced, and those the
    kernel cannot serve go column-major); returns how many weights moved."""
    if layout not in LAYOUTS:
        raise ValueError(f"weight layout must be one of {LAYOUTS}, got {layout!r}")
    if any(isinstance(m, PackedLinear) for m in module.modules()):
        raise ValueError("this module's weights are packed already: a layout is chosen once, when it is built")
    if layout in ("packed", "mixed"):
        # a linear the kernel cannot serve (not fp32) stays an nn.Linear: _move_dense leaves it in torch's layout
        swapped, _ = to_packed_linears_(module, skip=skip, keep_dense=layout == "mixed")
        return swapped + _move_dense(module, "col", skip)
    return _move_dense(module, layout, skip)


def _move_dense(module: nn.Module, layout: str, skip: tuple[nn.Module, ...]) -> int:
    """row or col for every fp32 nn.Linear weight of `module` but those in `skip`; how many moved."""
    moved = 0
    for m in module.modules():
        if not isinstance(m, nn.Linear) or m.weight.dtype != torch.float32 or any(m is s for s in skip):
            continue
        if (layout == "col") != is_col_major(m.weight):
            w = m.weight
            m.weight.data = w.t().contiguous().t() if layout == "col" else w.contiguous()
            moved += 1
    return moved

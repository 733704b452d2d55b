"""The engine's linear weights in memory: row-major (torch's default) or column-major.

A linear weight is `[out, in]` in either layout (names, shapes, values and checkpoints are
unchanged); column-major stores it over `[in, out]` contiguous memory (`w.t().contiguous().t()`).
A decode step multiplies one or a few rows by every weight, and on a CPU the BLAS kernel MKL picks
for that depends on the layout. One stage step of 15 layers of SmolLM2-135M's shape, fp32, one
thread, a 2-core AMD EPYC, by rows in the step (`spd measure stage-width-time --layers 15 --widths
1,2,3,4,6,9 --layouts row,col`, docs/speed.md):

    rows              1      2      3      4      6      9
    row-major      21.2   31.6   36.5   28.7   32.9   37.9  ms
    column-major   17.6   23.9   28.7   32.3   36.1   41.0

so `col` is the default on a CPU (`auto`): a one-row step is about a fifth cheaper, a step of 4 or
more rows about a tenth dearer. Only fp32 weights move (the layouts were compared in fp32 only),
and on a GPU `auto` keeps torch's layout.

The layout changes the kernel, hence float rounding: every model whose outputs are compared with
each other (a run's stages, its greedy reference, the replays) is built with the same layout, so a
run resolves it once (`RunConfig.resolved_weight_layout`) and the builders apply it
(engine/runtime/build.py), never a module global.
"""
from __future__ import annotations

import torch
from torch import nn

LAYOUTS = ("row", "col")


def resolve_layout(layout: str, device: str) -> str:
    """`auto` -> col on a CPU, row elsewhere; otherwise checked."""
    if layout == "auto":
        return "col" if device.startswith("cpu") else "row"
    if layout not in LAYOUTS:
        raise ValueError(f"weight layout must be auto or one of {LAYOUTS}, got {layout!r}")
    return layout


def is_col_major(w: torch.Tensor) -> bool:
    """Whether a 2-D weight `[out, in]` lies over `[in, out]` contiguous memory."""
    return w.dim() == 2 and min(w.shape) > 1 and w.t().is_contiguous()


@torch.no_grad()
def set_weight_layout_(module: nn.Module, layout: str, skip: tuple[nn.Module, ...] = ()) -> int:
    """Store every fp32 `nn.Linear` weight of `module` (but those in `skip`) in `layout`, in place
    (the Parameter objects stay); returns how many weights moved."""
    if layout not in LAYOUTS:
        raise ValueError(f"weight layout must be one of {LAYOUTS}, got {layout!r}")
    moved = 0
    for m in module.modules():
        if not isinstance(m, nn.Linear) or m.weight.dtype != torch.float32 or any(m is s for s in skip):
            continue
        if (layout == "col") != is_col_major(m.weight):
            w = m.weight
            m.weight.data = w.t().contiguous().t() if layout == "col" else w.contiguous()
            moved += 1
    return moved

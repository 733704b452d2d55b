"""A linear layer over oneDNN's packed fp32 weight: a step of a few rows for the price of one.

A decode step multiplies one row, or the few rows of a suffix run (docs/design.md 3.13), by every
weight. MKL's kernels for that re-read the weight per row (column-major, engine/model/linear.py:
a 15-layer SmolLM2 step of 4 rows costs 1.8x one row on a 2-core AMD EPYC), while oneDNN's blocked
kernel over a weight reordered once (`torch.ops.mkldnn._reorder_linear_weight`, the prepacking
torch's own CPU compiler uses) streams it once for up to about 6 rows, and splits one step over
the intra-op threads. Below `MIN_ROWS` rows oneDNN takes another, slower path, so fewer rows are
padded with zero rows (rows are independent; the padding's outputs are dropped). With one
thread, a one-row step is cheaper over a column-major weight (MKL's matrix-vector kernel): the
`mixed` layout keeps that copy too (twice the weights' memory) and sends one row through it.

Rounding: each output row's value depends on the kernel's blocking, not on the other rows, on the
hosts measured (a row's result is the same bits whether it is computed alone, padded, or among up
to `PROBE_ROWS` rows); `PackedLinear.from_linear` checks this on the running host and says so in
`row_invariant`, and checks the kernel against `packed_linear_reference` (plain torch). Where
oneDNN is missing or the probe fails, `from_linear` returns None and the caller keeps its
nn.Linear.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

MIN_ROWS = 4  # fewer rows go through oneDNN's one-row path, slower than 4 rows on the host measured
PACK_ROWS = 8  # the row count the weight's blocking is chosen for (oneDNN's batch-size hint)
PROBE_ROWS = 9  # rows of the invariance probe: a run of 8 tokens and one more
PROBE_TOL = 1e-4  # relative to the output's scale: fp32, any summation order


def packed_linear_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] -> [..., N]: x @ weight^T (+ bias), plain torch."""
    return F.linear(x, weight, bias)


def packed_kernel_available() -> bool:
    """Whether this torch has oneDNN's prepacked linear on the CPU."""
    if not torch.backends.mkldnn.is_available():
        return False
    ops = torch.ops.mkldnn
    return hasattr(ops, "_reorder_linear_weight") and hasattr(ops, "_linear_pointwise")


def _packed_mm(x2: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x2 [M, K] fp32 -> [M, N], fewer than MIN_ROWS rows padded."""
    m = x2.shape[0]
    if m < MIN_ROWS:
        x2 = F.pad(x2, (0, 0, 0, MIN_ROWS - m))
    y = torch.ops.mkldnn._linear_pointwise(x2, packed, bias, "none", [], "")
    return y[:m] if m < MIN_ROWS else y


class PackedLinear(nn.Module):
    """An fp32 nn.Linear's replacement over a packed weight (an opaque oneDNN tensor, not a
    Parameter: it has no strides and no storage); `bias` is a buffer; `weight` unpacks a copy."""

    def __init__(self, packed: torch.Tensor, bias: torch.Tensor | None, row_invariant: bool,
                 dense: torch.Tensor | None = None) -> None:
        super().__init__()
        self.packed = packed  # [N, K] fp32, oneDNN's blocked layout
        self.register_buffer("bias", bias)
        # mixed layout: one row goes through the column-major weight [N, K] (MKL's one-thread
        # matrix-vector kernel, cheaper for one row than the padded packed step), several through `packed`
        self.dense = dense
        self.out_features, self.in_features = packed.shape
        self.row_invariant = row_invariant

    def resident_bytes(self) -> int:
        """The packed weight's bytes (fp32), and its column-major copy's where it keeps one."""
        return 4 * self.out_features * self.in_features * (1 if self.dense is None else 2)

    @property
    def weight(self) -> torch.Tensor:
        """The dense [N, K] weight (a copy): for inspection and export, not for the hot path."""
        return self.packed.to_dense()

    @classmethod
    @torch.no_grad()
    def from_linear(cls, lin: nn.Linear, seed: int = 0, keep_dense: bool = False) -> "PackedLinear | None":
        """The packed form of `lin` (with `keep_dense`, also its column-major copy for one-row
        steps), or None where it cannot serve (no oneDNN, not an fp32 CPU weight, or the probe
        disagrees with the reference)."""
        w = lin.weight.detach()
        if not packed_kernel_available() or w.dtype != torch.float32 or w.device.type != "cpu":
            return None
        bias = None if lin.bias is None else lin.bias.detach().float().contiguous()
        packed = torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), PACK_ROWS)
        x = torch.randn(PROBE_ROWS, w.shape[1], generator=torch.Generator().manual_seed(seed))
        got = _packed_mm(x, packed, bias)  # [PROBE_ROWS, N]
        want = packed_linear_reference(x.double(), w.double(), None if bias is None else bias.double())
        if not (got.double() - want).abs().max() <= PROBE_TOL * (want.abs().max() + 1e-6):
            return None
        invariant = all(torch.equal(_packed_mm(x[:m], packed, bias), got[:m]) for m in range(1, PROBE_ROWS))
        return cls(packed, bias, invariant, w.t().contiguous().t() if keep_dense else None)

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        """The nn.Linear's names and values: `weight` unpacked, so checkpoints and copies of a
        layer into a draft head (train/) see what they would without the packing."""
        destination[prefix + "weight"] = self.weight
        super()._save_to_state_dict(destination, prefix, keep_vars)

    @torch.no_grad()
    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs) -> None:
        w = state_dict.get(prefix + "weight")
        if w is None:
            missing_keys.append(prefix + "weight")
        elif tuple(w.shape) != (self.out_features, self.in_features):
            error_msgs.append(f"size mismatch for {prefix}weight: {tuple(w.shape)} in the checkpoint, "
                              f"{(self.out_features, self.in_features)} here")
        else:
            w = w.detach().float().contiguous()
            self.packed = torch.ops.mkldnn._reorder_linear_weight(w, PACK_ROWS)
            self.dense = None if self.dense is None else w.t().contiguous().t()
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        if prefix + "weight" in unexpected_keys:  # not a Parameter here, but read above
            unexpected_keys.remove(prefix + "weight")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])  # [M, K]
        if self.dense is not None and x2.shape[0] == 1:
            return F.linear(x, self.dense, self.bias)
        y = _packed_mm(x2, self.packed, self.bias)  # [M, N]
        return y.reshape(*shape[:-1], self.out_features)


def to_packed_linears_(module: nn.Module, skip: tuple[nn.Module, ...] = (), keep_dense: bool = False
                       ) -> tuple[int, int]:
    """Replace every fp32 CPU nn.Linear inside `module` (but those in `skip`) by its PackedLinear
    (`keep_dense`: with a column-major copy for one-row steps); returns (replaced, left as
    nn.Linear because the kernel could not serve them)."""
    swapped = kept = 0
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if not isinstance(child, nn.Linear) or any(child is s for s in skip):
                continue
            packed = PackedLinear.from_linear(child, keep_dense=keep_dense)
            if packed is None:
                kept += 1
            else:
                setattr(parent, name, packed)
                swapped += 1
    return swapped, kept

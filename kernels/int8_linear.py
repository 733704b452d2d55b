"""A linear layer over int8 weight rows: the draft heads' matmuls, reading a quarter of fp32's bytes.

A PDM step multiplies two or three rows by every weight of its decoder layers and its draft head,
so it reads all of them each tick, on the driver's rank. Stored as int8 rows `q` with per-row
scales `s` (bf16), a weight is `q s`; torch's `_weight_int8pack_mm` multiplies bf16 rows by it
with fp32 accumulation. On a 2-core AMD EPYC, one thread, a whole PDM step of the n=2 SmolLM2
head's shape (2 decoder layers, an 8192-id head, 3 rows) took 6.60 ms in fp32, 4.44 in bf16 and
3.03 in int8 (`spd measure pdm-vocab-time --draft-vocab DV --stage-layers 15,15 --pdm-layers 2
--precisions`, docs/results/speed-2core-epyc.md). Drafts only: the engine's output never depends on them.

`int8_linear_reference` is the plain torch form (the dequantized weight in bf16, F.linear); the
kernel is used where it exists and was checked against it at construction (`Int8Linear.from_linear`),
on a CPU with in-features a multiple of 16 (its vector width), else the reference runs.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from spd_engine.kernels.screened_argmax import quantize_rows  # int8 rows, bf16 scales rounded up: the screen's

PROBE_TOL = 2e-2  # relative to the output's scale: bf16 rounding of inputs and result, any summation order


def int8_linear_reference(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, bias: torch.Tensor | None = None
                          ) -> torch.Tensor:
    """x [..., K] -> [..., N] bf16: x @ (q s)^T (+ bias), plain torch."""
    w = (q.float() * s.float()[:, None]).to(torch.bfloat16)
    return F.linear(x.to(torch.bfloat16), w, None if bias is None else bias.to(torch.bfloat16))


def int8_kernel_available() -> bool:
    """Whether this torch has the CPU int8-weight kernel."""
    return hasattr(torch, "_weight_int8pack_mm")


def kernel_supported(q: torch.Tensor) -> bool:
    return q.device.type == "cpu" and q.shape[1] % 16 == 0 and int8_kernel_available()


class Int8Linear(nn.Module):
    """An nn.Linear's replacement over int8 rows; output bf16. `q`, `s` and `bias` are buffers."""

    def __init__(self, q: torch.Tensor, s: torch.Tensor, bias: torch.Tensor | None, kernel: bool) -> None:
        super().__init__()
        self.register_buffer("q", q)  # [N, K] int8
        self.register_buffer("s", s)  # [N] bf16
        self.register_buffer("bias", None if bias is None else bias.detach().to(torch.bfloat16))
        self.kernel = kernel
        self.dequant: torch.Tensor | None = None  # without the kernel: the bf16 weight int8_linear_reference uses
        self.in_features, self.out_features = q.shape[1], q.shape[0]

    @classmethod
    @torch.no_grad()
    def from_linear(cls, lin: nn.Linear, seed: int = 0) -> "Int8Linear":
        q, s = quantize_rows(lin.weight.detach().float().contiguous())
        out = cls(q, s, lin.bias, kernel_supported(q))
        if out.kernel:  # a probe: the kernel must agree with the reference, else the reference runs
            x = torch.randn(3, q.shape[1], generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
            want = int8_linear_reference(x, q, s).float()
            got = torch._weight_int8pack_mm(x, q, s).float()
            out.kernel = bool((got - want).abs().max() <= PROBE_TOL * (want.abs().max() + 1e-6))
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.kernel:  # the reference, its dequantized weight made once
            if self.dequant is None:
                self.dequant = (self.q.float() * self.s.float()[:, None]).to(torch.bfloat16)  # [N, K]
            return F.linear(x.to(torch.bfloat16), self.dequant, self.bias)
        shape = x.shape
        y = torch._weight_int8pack_mm(x.reshape(-1, shape[-1]).to(torch.bfloat16), self.q, self.s)  # [M, N] bf16
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features)


def to_int8_linears_(module: nn.Module) -> int:
    """Replace every nn.Linear inside `module` by an Int8Linear of its weight; returns how many."""
    swapped = 0
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, Int8Linear.from_linear(child))
                swapped += 1
    return swapped

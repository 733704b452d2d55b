"""Greedy token of an LM head from an int8 screen: the fp32 argmax, reading a quarter of the bytes.

A batch-1 decode step on a CPU multiplies one normed hidden state h [H] by the head W [V, H] for a
single argmax, and that reads all of W: SmolLM2-135M's 49152 x 576 fp32 head is 113 MB, 10.2 ms
of the last stage's share of a co-located n=2 tick (`spd bench` breakdown). The screen keeps an int8
copy of W (per-row scales s_v, rounded up to bf16 so that |W - q s| <= s/2 elementwise) and
multiplies h in bf16 by it with torch's `_weight_int8pack_mm` (fp32 accumulation, a bf16 result):
28 MB read; the screened pass took 4.7 ms in the same command's breakdown (another run). Each
approximate logit a_v is within

    e_v = c_H s_v ||h||_1 + |a_v| / 128 + 1e-5    (c_H = 1.05 up to H of about 2900)

of the fp32 logit: s_v ||h||_1 / 2 from the int8 rounding of W, 2^-8 * 127 s_v ||h||_1 from the
bf16 rounding of h, the fp32 accumulation over H terms (below the 5% slack up to H of about 2900;
`slack_coefficient` grows it beyond), and 2^-8 |a| from the bf16 result. So the fp32 argmax lies among the rows whose upper bound a_v + e_v reaches the largest
lower bound max_u (a_u - e_u); those rows (a few dozen on real text) are recomputed in fp32 from W.
The subset's product may sum in another order than the full one, so the winner is taken only when
its margin over every other candidate exceeds twice the fp32 error bound of an H-term dot product
(gamma_H sum|h w|, any order); a near-tie or an exact tie (rare on real text) falls back to the full
product. The token is therefore always `reference_argmax`'s, the plain full-head argmax.

Only where it pays and is sound: a CPU, an fp32 head, torch's int8 kernel present and H a multiple
of 16 (the kernel's vector width; other widths gave wrong results in testing). A probe at
construction checks the kernel against plain torch and refuses the screen (`ScreenedHead.build`
returns None) if an error exceeds its bound.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

SLACK = 1.05  # on s_v ||h||_1: 0.5 (W's int8 rounding) + 0.496 (h in bf16) + fp32 accumulation (small H)
RESULT_REL = 1.0 / 128  # the bf16 result's rounding, 2^-8 |a|, doubled
ABS_FLOOR = 1e-5


def reference_argmax(h: torch.Tensor, weight: torch.Tensor) -> int:
    """The specification: argmax of the fp32 logits h [H] @ weight [V, H]^T (first index on ties)."""
    return int(F.linear(h, weight).argmax())


def slack_coefficient(H: int) -> float:
    """The factor on s_v ||h||_1 in e_v: int8 rounding of W (0.5, plus the fp32 division's 1e-5), bf16
    rounding of h (127 * 2^-8), and the fp32 accumulation of both the int8 product and the full one
    (2 * 127 * gamma_H, any summation order, h's bf16 growth included); SLACK or more."""
    gamma = H * 2.0 ** -24 / (1 - H * 2.0 ** -24)
    return max(SLACK, 0.5 + 1e-5 + 127 * 2.0 ** -8 + 2 * 127 * gamma * (1 + 2.0 ** -8) + 0.01)


def supported(weight: torch.Tensor) -> bool:
    """Whether the screen can run for this head weight [V, H]."""
    return (weight.device.type == "cpu" and weight.dtype == torch.float32 and weight.dim() == 2
            and weight.shape[1] % 16 == 0 and hasattr(torch, "_weight_int8pack_mm"))


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [V, H] fp32 -> (q [V, H] int8, scales [V] bf16), scales rounded up so |w / s| <= 127."""
    scale = (weight.abs().amax(dim=1) / 127.0).clamp(min=1e-30)  # [V] fp32
    s16 = scale.to(torch.bfloat16)
    s16 = torch.where(s16.float() < scale, torch.nextafter(s16, torch.full_like(s16, float("inf"))), s16)
    q = torch.round(weight / s16.float()[:, None]).clamp(-127, 127).to(torch.int8)  # [V, H]
    return q, s16


class ScreenedHead:
    """The int8 screen of one head weight (kept by reference for the fp32 recomputation)."""

    def __init__(self, weight: torch.Tensor) -> None:
        assert supported(weight), (weight.device, weight.dtype, tuple(weight.shape))
        self.weight = weight  # [V, H] fp32, shared with the model
        self.q, self.scales = quantize_rows(weight.detach())  # [V, H] int8, [V] bf16
        self.slack = self.scales.float() * slack_coefficient(weight.shape[1])  # [V]
        self.last_candidates = 0  # rows recomputed by the last call (tests, profiling)
        self.fallbacks = 0  # calls that needed the full product (near-ties)

    @classmethod
    def build(cls, weight: torch.Tensor, probes: int = 4, seed: int = 0) -> "ScreenedHead | None":
        """A screen for `weight`, or None where unsupported or where the probe finds the kernel's
        error outside the bound (the head then stays on the plain fp32 argmax)."""
        if not supported(weight):
            return None
        screen = cls(weight)
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for _ in range(probes):
                h = torch.randn(weight.shape[1], generator=gen)  # [H]
                a, e = screen.bounds(h)
                if bool(((a - F.linear(h, weight)).abs() > e).any()):
                    return None
        return screen

    def bounds(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Approximate logits a [V] (fp32 from bf16) and their error bounds e [V] for h [H] fp32."""
        a = torch._weight_int8pack_mm(h.to(torch.bfloat16)[None], self.q, self.scales)[0].float()  # [V]
        e = self.slack * h.abs().sum() + a.abs() * RESULT_REL + ABS_FLOOR  # [V]
        return a, e

    @torch.no_grad()
    def argmax(self, h: torch.Tensor) -> int:
        """The argmax of F.linear(h, W) for h [H] fp32: screened, the candidates recomputed in fp32,
        and where two of them are too close for summation order to settle, the full product."""
        assert h.dim() == 1, f"one hidden state [H] at a time, got {tuple(h.shape)}"
        a, e = self.bounds(h)
        return self._settle(h, a, e)

    @torch.no_grad()
    def argmax_rows(self, h: torch.Tensor) -> list[int]:
        """`argmax` of every row of h [R, H] fp32, the screen's int8 product run once for all rows
        (a suffix run's exit rows): each row's bound is the one-row bound, whatever the kernel's order."""
        assert h.dim() == 2, f"rows [R, H], got {tuple(h.shape)}"
        a = torch._weight_int8pack_mm(h.to(torch.bfloat16), self.q, self.scales).float()  # [R, V]
        e = self.slack * h.abs().sum(-1, keepdim=True) + a.abs() * RESULT_REL + ABS_FLOOR  # [R, V]
        return [self._settle(h[r], a[r], e[r]) for r in range(h.shape[0])]

    def _settle(self, h: torch.Tensor, a: torch.Tensor, e: torch.Tensor) -> int:
        """The argmax for h [H] from its approximate logits a [V] and their bounds e [V]."""
        floor = (a - e).max()
        cand = torch.nonzero(a + e >= floor).flatten()  # [C] ascending ids; the argmax is among them
        self.last_candidates = cand.numel()
        w = self.weight.index_select(0, cand)  # [C, H]
        exact = F.linear(h, w)  # [C] fp32
        best = int(exact.argmax())
        if cand.numel() > 1:
            # any order of an H-term fp32 dot product is within gamma_H sum|h w| of the true value, so
            # the full product ranks `best` first for sure when its margin exceeds both errors
            H = h.shape[0]
            gamma = H * 2.0 ** -24 / (1 - H * 2.0 ** -24)
            err = 2 * gamma * F.linear(h.abs(), w.abs())  # [C]
            low, high = exact - err, (exact + err).index_fill(0, torch.tensor([best]), float("-inf"))
            if not bool(low[best] > high.max()):  # host sync: a near-tie, settled as the reference does
                self.fallbacks += 1
                return reference_argmax(h, self.weight)
        return int(cand[best])  # host sync: the caller needs the id

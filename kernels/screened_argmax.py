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
`slack_coefficient` grows it beyond), and 2^-8 |a| from the bf16 result. So the fp32 argmax lies among the
rows whose upper bound a_v + e_v reaches the largest
lower bound max_u (a_u - e_u); those rows (a few dozen on real text) are recomputed in fp32 from W.
The subset's product may sum in another order than the full one, so the winner is taken only when
its margin over every other candidate exceeds twice the fp32 error bound of an H-term dot product
(gamma_H sum|h w|, any order); a near-tie or an exact tie (rare on real text) falls back to the full
product. The token is therefore always `reference_argmax`'s, the plain full-head argmax.

Several rows at once (a suffix run's exit rows, a batch's) take another product, since the
bf16 kernel's time grows with the rows (one row 3.4 ms, 8 rows 12.5 on the SmolLM2 head, one EPYC
thread) while an int8 x int8 product (`torch._int_mm`, exact int32 sums) hardly does. Each row of
h is written as two int8 digits, h ~ c1 g1 + c2 g2 (c1 = max|h| / 127, c2 the same of the
remainder's), so 2R int8 rows go through one product, and a_v = s_v (c1 <g1, q_v> + c2 <g2, q_v>).
With D >= ||h - c1 g1 - c2 g2||_1 (computed in float64) each logit is within

    e_v = s_v [(1/2 + 1e-4)(||h||_1 + D) + 127 D + 127 gamma_H ||h||_1 + 127 * 2^-20 (||h||_1 + H c1)] + 1e-5

of the fp32 one: W's int8 rounding over h's digits, h's remainder against |W| <= 127 s_v, the
fp32 reference's own accumulation, and the fp32 arithmetic that turns the sums into logits.
`argmax_rows` uses it from ROWS_INT8_MIN rows, for hidden sizes up to ROWS_INT8_MAX_H, where
`torch._int_mm` exists and a probe at construction finds it within the bound; the candidates are
settled in fp32 as for one row. Fewer rows, or a wider head, stay on the bf16 kernel: on a 2-core
AMD EPYC, one thread, the int8 x int8 product took 0.8-1.0x the bf16 kernel's time at 1-4 rows and
1.4-1.6x less at 5-8 for H of 576 to 1536 (SmolLM2, Qwen2.5-0.5B's 151936 x 896), but not at H =
2048 (`spd measure screen-rows-time [--shape V,H]`).

Only where it pays and is sound: a CPU, an fp32 head, torch's int8 kernel present and H a multiple
of 16 (the kernel's vector width; other widths gave wrong results in testing). A probe at
construction checks the kernel against plain torch and refuses the screen (`ScreenedHead.build`
returns None) if an error exceeds its bound.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

ROWS_INT8_MIN = 5  # rows from which argmax_rows takes the int8 x int8 product (module docstring)
ROWS_INT8_MAX_H = 1536  # ... for hidden sizes up to this
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


def int8_digits(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """h [R, H] fp32 -> (digits [2R, H] int8: rows g1 then rows g2, c1 [R, 1], c2 [R, 1] fp32, and D [R]
    float64 >= ||h - c1 g1 - c2 g2||_1): h's rows as two int8 digits each."""
    c1 = (h.abs().amax(-1, keepdim=True) / 127.0).clamp(min=1e-30)  # [R, 1]
    g1 = torch.round(h / c1).clamp(-127, 127)
    rest = h - c1 * g1  # [R, H]: only g2 depends on its rounding; D is exact either way
    c2 = (rest.abs().amax(-1, keepdim=True) / 127.0).clamp(min=1e-30)
    g2 = torch.round(rest / c2).clamp(-127, 127)
    # float64: each product of an fp32 scale and an integer up to 127 is exact, the sums nearly
    d = (h.double() - c1.double() * g1.double() - c2.double() * g2.double()).abs().sum(-1) * (1 + 1e-9)
    return torch.cat([g1, g2]).to(torch.int8), c1, c2, d


class ScreenedHead:
    """The int8 screen of one head weight (kept by reference for the fp32 recomputation)."""

    def __init__(self, weight: torch.Tensor) -> None:
        assert supported(weight), (weight.device, weight.dtype, tuple(weight.shape))
        self.weight = weight  # [V, H] fp32, shared with the model
        self.q, self.scales = quantize_rows(weight.detach())  # [V, H] int8, [V] bf16
        self.slack = self.scales.float() * slack_coefficient(weight.shape[1])  # [V]
        # several rows through the int8 x int8 product (where it pays: ROWS_INT8_MIN, ROWS_INT8_MAX_H)
        self.rows_int8 = hasattr(torch, "_int_mm") and weight.shape[1] <= ROWS_INT8_MAX_H
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
            if screen.rows_int8:  # the several-row product too, else those rows take the bf16 kernel
                h = torch.randn(3, weight.shape[1], generator=gen) * torch.tensor([[0.1], [1.0], [30.0]])
                try:
                    a, e = screen.bounds_rows(h)
                    screen.rows_int8 = not bool(((a - F.linear(h, weight)).abs() > e).any())
                except RuntimeError:  # a torch whose _int_mm refuses these shapes on this CPU
                    screen.rows_int8 = False
        return screen

    def bounds(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Approximate logits a [V] (fp32 from bf16) and their error bounds e [V] for h [H] fp32."""
        a, e = self.bounds_rows_bf16(h[None])
        return a[0], e[0]

    def bounds_rows_bf16(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`bounds` of every row of h [R, H] fp32 from one bf16-kernel product: a, e [R, V]."""
        a = torch._weight_int8pack_mm(h.to(torch.bfloat16), self.q, self.scales).float()  # [R, V]
        e = self.slack * h.abs().sum(-1, keepdim=True) + a.abs() * RESULT_REL + ABS_FLOOR  # [R, V]
        return a, e

    @torch.no_grad()
    def argmax(self, h: torch.Tensor) -> int:
        """The argmax of F.linear(h, W) for h [H] fp32: screened, the candidates recomputed in fp32,
        and where two of them are too close for summation order to settle, the full product."""
        assert h.dim() == 1, f"one hidden state [H] at a time, got {tuple(h.shape)}"
        a, e = self.bounds(h)
        return self._settle(h, a, e)

    def bounds_rows(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Approximate logits a [R, V] and bounds e [R, V] for h [R, H] fp32 from one int8 x int8
        product of h's two int8 digits per row (the module docstring's several-row bound)."""
        R, H = h.shape
        digits, c1, c2, d = int8_digits(h)
        sums = torch._int_mm(digits, self.q.t()).float()  # [2R, V]: exact int32 sums, then fp32
        s = self.scales.float()  # [V]
        a = (c1 * sums[:R] + c2 * sums[R:]) * s  # [R, V]
        gamma = H * 2.0 ** -24 / (1 - H * 2.0 ** -24)
        l1, d = h.abs().sum(-1, keepdim=True).double(), d[:, None]  # [R, 1]
        c = (0.5 + 1e-4) * (l1 + d) + 127 * d + 127 * gamma * l1 + 127 * 2.0 ** -20 * (l1 + H * c1.double())
        return a, s * c.float() + ABS_FLOOR

    @torch.no_grad()
    def argmax_rows(self, h: torch.Tensor) -> list[int]:
        """`argmax` of every row of h [R, H] fp32, one product for all rows (a suffix run's exit rows,
        a batch's): the int8 x int8 one where it passed its probe, else the bf16 kernel's; each row
        settled alone, its bound whatever the kernel's order."""
        assert h.dim() == 2, f"rows [R, H], got {tuple(h.shape)}"
        use_int8 = self.rows_int8 and h.shape[0] >= ROWS_INT8_MIN
        a, e = self.bounds_rows(h) if use_int8 else self.bounds_rows_bf16(h)
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

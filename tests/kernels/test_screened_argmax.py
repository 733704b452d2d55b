"""The int8-screened greedy token (kernels/screened_argmax.py) against the plain fp32 argmax."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from spd_engine.kernels.screened_argmax import (
    ROWS_INT8_MIN,
    ScreenedHead,
    int8_digits,
    quantize_rows,
    reference_argmax,
    supported,
)

pytestmark = pytest.mark.skipif(not hasattr(torch, "_weight_int8pack_mm"), reason="torch lacks its int8 kernel")


def _head(V: int = 4096, H: int = 128, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return 0.05 * torch.randn(V, H, generator=gen)  # [V, H]


def test_quantized_rows_stay_within_half_a_step():
    w = _head()
    q, s = quantize_rows(w)
    assert q.dtype == torch.int8 and s.dtype == torch.bfloat16
    assert int(q.abs().max()) <= 127
    err = (w - q.float() * s.float()[:, None]).abs()  # [V, H]
    assert bool((err <= s.float()[:, None] / 2 * (1 + 1e-6)).all())


def test_bounds_hold_and_the_token_is_the_fp32_argmax():
    w = _head()
    screen = ScreenedHead.build(w)
    assert screen is not None
    gen = torch.Generator().manual_seed(1)
    sizes = []
    for i in range(200):
        h = torch.randn(w.shape[1], generator=gen) * (0.5 + i % 7)  # [H], several scales
        a, e = screen.bounds(h)
        assert bool(((a - F.linear(h, w)).abs() <= e).all())
        assert screen.argmax(h) == reference_argmax(h, w)
        sizes.append(screen.last_candidates)
    assert screen.fallbacks < 10  # random heads have close logits; real ones almost never fall back
    assert sorted(sizes)[len(sizes) // 2] < w.shape[0] // 4  # it screens: most rows are never recomputed


def test_rows_at_once_equal_the_fp32_argmax_of_each_row():
    """argmax_rows (a suffix run's exit rows): one int8 product for all rows, each row settled alone."""
    w = _head()
    screen = ScreenedHead.build(w)
    gen = torch.Generator().manual_seed(2)
    for R in (1, 2, 3, 5, 8):
        h = torch.randn(R, w.shape[1], generator=gen) * torch.linspace(0.5, 4.0, R)[:, None]  # [R, H]
        assert screen.argmax_rows(h) == [reference_argmax(row, w) for row in h]
    tie = w.clone()
    h = torch.randn(2, w.shape[1], generator=gen)
    tie[5] = w[reference_argmax(h[1], w)]  # an exact tie in the second row: the lower id, as torch.argmax
    screen = ScreenedHead.build(tie)
    assert screen.argmax_rows(h) == [reference_argmax(row, tie) for row in h]


def test_two_int8_digits_and_their_remainder_bound():
    gen = torch.Generator().manual_seed(4)
    h = torch.randn(3, 128, generator=gen) * torch.tensor([[1e-3], [1.0], [40.0]])
    h[1, 7] = 25.0  # an outlier: the first digit's step grows, the second digit takes the rest
    digits, c1, c2, d = int8_digits(h)
    assert digits.dtype == torch.int8 and digits.shape == (6, 128)
    approx = c1.double() * digits[:3].double() + c2.double() * digits[3:].double()  # [3, H]
    exact = (h.double() - approx).abs().sum(-1)
    assert bool((exact <= d).all()) and bool((d <= exact * (1 + 1e-6) + 1e-30).all())
    assert bool((d <= 128 * c2[:, 0].double()).all())  # about half a second-digit step per element
    zero = int8_digits(torch.zeros(1, 16))
    assert int(zero[0].abs().sum()) == 0 and float(zero[3]) == 0.0


@pytest.mark.skipif(not hasattr(torch, "_int_mm"), reason="torch lacks its int8 x int8 product")
def test_several_rows_through_the_int8_product_are_bounded_and_exact():
    """bounds_rows (the int8 x int8 product of two digits per row) holds its bound on every logit,
    is tighter than the one-row screen's, and argmax_rows from ROWS_INT8_MIN rows gives each row's
    fp32 argmax, ties and near-ties included; a kernel off by 1% fails the probe."""
    w = _head()
    screen = ScreenedHead.build(w)
    if not screen.rows_int8:  # refused by its probe on this CPU: argmax_rows stays on the bf16 kernel
        pytest.skip("the int8 x int8 product failed its probe on this CPU")
    gen = torch.Generator().manual_seed(5)
    h = torch.randn(12, w.shape[1], generator=gen) * torch.linspace(0.1, 30.0, 12)[:, None]  # [R, H]
    a, e = screen.bounds_rows(h)
    assert bool(((a - F.linear(h, w)).abs() <= e).all())
    one = torch.stack([screen.bounds(row)[1] for row in h])  # the one-row screen's bounds [R, V]
    assert float(e.mean()) < float(one.mean())
    for R in (ROWS_INT8_MIN, 8, 12):
        assert screen.argmax_rows(h[:R]) == [reference_argmax(row, w) for row in h[:R]]
    tie = w.clone()
    tie[9] = w[reference_argmax(h[2], w)]  # an exact tie in row 2: the lower id, as torch.argmax
    tied = ScreenedHead.build(tie)
    assert tied.argmax_rows(h[:ROWS_INT8_MIN]) == [reference_argmax(row, tie) for row in h[:ROWS_INT8_MIN]]


def test_the_bounds_hold_where_every_rounding_error_adds_up():
    """An adversarial head: each weight sits 0.49 of a quantization step from its int8 value, on
    the side of h's sign, so the screen's error is nearly its worst case (0.49 s ||h||_1): both
    products' bounds must still hold (a bound that assumed errors cancel would not)."""
    H, step = 128, 2.0 ** -7  # the row scale, exact in bf16: max |w| = 127 steps
    gen = torch.Generator().manual_seed(6)
    h = torch.randn(ROWS_INT8_MIN, H, generator=gen) * 3.0  # [R, H]
    k = torch.randint(-100, 100, (64, H), generator=gen).float()
    w = step * (k + 0.49 * torch.sign(h[0]))  # [V, H]: errors aligned with row 0's signs
    w[:, 0] = 127 * step
    screen = ScreenedHead.build(w)
    assert torch.equal(screen.q[:, 1:].float(), k[:, 1:])  # each weight rounds to k: the error is 0.49 steps
    exact = F.linear(h, w)  # [R, V]
    a1, e1 = screen.bounds(h[0])
    worst = (a1 - exact[0]).abs()
    assert float(worst.max()) > 0.4 * step * float(h[0].abs().sum())  # the errors did add up
    assert bool((worst <= e1).all())
    if screen.rows_int8:
        a, e = screen.bounds_rows(h)
        assert float((a[0] - exact[0]).abs().max()) > 0.4 * step * float(h[0].abs().sum())
        assert bool(((a - exact).abs() <= e).all())
        assert screen.argmax_rows(h) == [reference_argmax(row, w) for row in h]


def test_a_broken_int8_product_is_caught_by_the_probe(monkeypatch):
    if not hasattr(torch, "_int_mm"):
        pytest.skip("torch lacks its int8 x int8 product")
    real = torch._int_mm
    monkeypatch.setattr(torch, "_int_mm", lambda x, w: (real(x, w).double() * 1.01).round().to(torch.int32))
    screen = ScreenedHead.build(_head())
    assert screen is not None and not screen.rows_int8  # the rows stay on the bf16 kernel


def test_near_ties_and_exact_ties_go_where_the_fp32_argmax_goes():
    w = _head(V=512, H=64)
    h = torch.randn(64, generator=torch.Generator().manual_seed(3))
    best = reference_argmax(h, w)
    for other in [i for i in (0, 7, 511) if i != best]:
        w2 = w.clone()
        w2[other] = w[best]  # an exact tie: the lower id wins, as torch.argmax
        screen = ScreenedHead.build(w2)
        assert screen.argmax(h) == reference_argmax(h, w2) == min(other, best)
        w3 = w.clone()
        w3[other] = w[best] * (1 + 1e-6)  # a near-tie far below the int8 screen's resolution
        screen = ScreenedHead.build(w3)
        assert screen.argmax(h) == reference_argmax(h, w3)
        assert screen.fallbacks == 1  # settled by the full product, as the reference settles it


def test_refused_where_unsupported():
    assert not supported(torch.zeros(64, 10))  # H not a multiple of the kernel's 16
    assert not supported(torch.zeros(64, 64, dtype=torch.bfloat16))
    assert ScreenedHead.build(torch.zeros(64, 10)) is None


def test_a_broken_kernel_is_caught_by_the_probe(monkeypatch):
    """If the int8 kernel returned wrong logits, the probe refuses the screen."""
    real = torch._weight_int8pack_mm
    monkeypatch.setattr(torch, "_weight_int8pack_mm", lambda x, q, s: real(x, q, s) * 1.1)
    assert ScreenedHead.build(_head()) is None


def test_a_stage_with_the_head_takes_its_greedy_token_from_the_screen():
    from spd_engine.engine.model.model import StageModel, init_random_
    from spd_engine.engine.model.model_config import tiny_config

    cfg = tiny_config()
    model = init_random_(StageModel(cfg, range(0, 0), embedding=True, head=True)).eval()
    if not supported(model.output_weight()):
        pytest.skip(f"tiny config hidden size {cfg.hidden_size} is not a multiple of 16")
    assert model.use_head_screen()
    gen = torch.Generator().manual_seed(2)
    for _ in range(50):
        h = torch.randn(cfg.hidden_size, generator=gen)
        assert model.greedy_token(h) == int(model.logits(h).argmax())

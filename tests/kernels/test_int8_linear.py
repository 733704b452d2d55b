"""The int8-row linear layer of the draft heads (kernels/int8_linear.py) against its plain torch
reference, and a PDM running on it: drafts only, so the engine's output stays greedy's."""
from __future__ import annotations

import pytest
import torch
from helpers import random_prompts, reference, tiny_engine_config
from torch import nn

from spd_engine.engine.runtime.build import build_pdm
from spd_engine.engine.runtime.reference import ReferenceExecutor
from spd_engine.kernels.int8_linear import Int8Linear, int8_linear_reference, quantize_rows, to_int8_linears_


def test_quantized_rows_are_within_a_rounding_step():
    torch.manual_seed(0)
    w = torch.randn(40, 64)
    q, s = quantize_rows(w)
    assert q.dtype == torch.int8 and s.dtype == torch.bfloat16 and q.abs().max() <= 127
    assert torch.all((q.float() * s.float()[:, None] - w).abs() <= 0.51 * s.float()[:, None] + 1e-6)


@pytest.mark.parametrize("k,bias", [(64, False), (96, True), (40, False)])  # 40: no kernel (not a multiple of 16)
def test_int8_linear_equals_its_reference(k, bias):
    torch.manual_seed(k)
    lin = nn.Linear(k, 48, bias=bias)
    m = Int8Linear.from_linear(lin)
    # the kernel only where it may run (its probe may still refuse it on some CPU: the reference runs then)
    assert not m.kernel or (k % 16 == 0 and hasattr(torch, "_weight_int8pack_mm"))
    x = torch.randn(2, 3, k)
    got = m(x)
    want = int8_linear_reference(x, m.q, m.s, m.bias)
    assert got.shape == (2, 3, 48) and got.dtype == torch.bfloat16
    assert torch.allclose(got.float(), want.float(), rtol=2e-2, atol=2e-2 * want.abs().max().item())
    # and close to the fp32 layer it replaces: int8 rows and bf16 activations
    assert torch.allclose(got.float(), lin(x), rtol=5e-2, atol=5e-2 * lin(x).abs().max().item())


def test_to_int8_linears_swaps_every_linear():
    net = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Sequential(nn.Linear(32, 16, bias=False)))
    assert to_int8_linears_(net) == 2
    assert not any(isinstance(m, nn.Linear) for m in net.modules())


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_pdm_on_int8_matmuls_drafts_and_the_output_stays_greedy(arch, one_thread):
    ecfg = tiny_engine_config(arch, 2, True, pdm_dtype="int8")
    pdm = build_pdm(ecfg)
    assert isinstance(pdm.head, Int8Linear) and pdm.compute_dtype == torch.bfloat16
    assert not any(isinstance(m, nn.Linear) for m in pdm.stack.modules())
    assert all(isinstance(p, Int8Linear) for p in pdm.proj)  # the anchor projections too
    prompt = random_prompts(ecfg.model.cfg, [9], seed=2)[0]
    with ReferenceExecutor(ecfg) as ex:
        res = ex.generate(prompt, 20)
    assert res.tokens == reference(ecfg, prompt, 20)
    assert res.verified > 0


def test_int8_anchor_projections_give_each_row_its_types_projection(one_thread):
    """The driver's rows over int8 projections (PDM.rows_from_ring): each row is its type's
    projection of its slot's anchors 0..type, as the fp32 gather kernel computes, within bf16's
    and int8's rounding; rows of one type share a product, in any order of types."""
    ecfg = tiny_engine_config("llama", 4, True, pdm_dtype="float32")
    fp32 = build_pdm(ecfg)
    int8 = build_pdm(ecfg.replace(pdm_dtype="int8"))
    m, H = fp32.plan.num_types, ecfg.model.cfg.hidden_size
    ring = torch.randn(9, m, H)  # [S, m, H]
    slots = torch.tensor([4, 0, 7, 2, 2, 5])
    types = torch.tensor([m - 1, 0, 2, 1, m - 1, 0])
    want = fp32.rows_from_ring(ring, slots, types).float()  # [R, H]
    got = int8.rows_from_ring(ring, slots, types)
    assert got.shape == want.shape and got.dtype == torch.bfloat16
    assert (got.float() - want).abs().max() <= 0.03 * want.abs().max()
    for r in range(len(slots)):  # a row alone, through the rows_of_type path the prefill takes
        a = int(types[r])
        alone = int8.rows_of_type(ring[slots[r]][None], a)[0].float()
        assert torch.allclose(alone, got[r].float(), rtol=0, atol=1e-6 + 0.02 * float(alone.abs().max()))

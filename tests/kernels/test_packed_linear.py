"""oneDNN's packed linear (kernels/packed_linear.py) against its plain torch reference, the `packed`
weight layout that uses it (engine/model/linear.py), and a run built with it: the same values
through another kernel, so outputs agree with the other layouts up to float rounding, and a run is
lossless against its own greedy reference in that layout."""
from __future__ import annotations

import pytest
import torch
from helpers import tiny_cfg, tiny_engine_config
from near_ties import assert_greedy_agrees, teacher_forced
from torch import nn

from spd_engine.engine.model.greedy import greedy_generate
from spd_engine.engine.model.linear import resolve_layout, set_weight_layout_
from spd_engine.engine.model.model import StageModel, init_random_
from spd_engine.engine.runtime.build import build_pdm, build_stage_model
from spd_engine.kernels.packed_linear import (
    MIN_ROWS,
    PackedLinear,
    packed_kernel_available,
    packed_linear_reference,
    to_packed_linears_,
)

needs_kernel = pytest.mark.skipif(not packed_kernel_available(), reason="this torch has no oneDNN CPU linear")


@needs_kernel
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_equals_its_reference_at_every_row_count(bias):
    torch.manual_seed(1)
    lin = nn.Linear(64, 96, bias=bias)
    m = PackedLinear.from_linear(lin)
    assert m is not None and (m.bias is not None) == bias
    assert torch.equal(m.weight, lin.weight)  # unpacks to the same values
    for rows in range(1, 12):  # padded below MIN_ROWS, as they are
        x = torch.randn(rows, 64)
        want = packed_linear_reference(x.double(), lin.weight.double(), None if lin.bias is None else lin.bias.double())
        got = m(x)
        assert got.shape == (rows, 96) and got.dtype == torch.float32
        assert torch.allclose(got.double(), want, atol=1e-5, rtol=1e-5), (rows, (got.double() - want).abs().max())
    x3 = torch.randn(2, 3, 64)  # [B, T, K] as the layers call it
    assert torch.allclose(m(x3), lin(x3), atol=1e-5, rtol=1e-5)


@needs_kernel
def test_row_invariance_holds_where_the_probe_claims_it():
    """Claims only what the probe saw on this host: where it says a row's bits do not depend on the
    rows beside it, a fresh input bears it out (at and above MIN_ROWS too)."""
    torch.manual_seed(2)
    m = PackedLinear.from_linear(nn.Linear(128, 80))
    if not m.row_invariant:
        pytest.skip("this host's oneDNN rounds a row by the rows beside it")
    x = torch.randn(2 * MIN_ROWS + 1, 128)
    full = m(x)
    for rows in range(1, x.shape[0]):
        assert torch.equal(m(x[:rows]), full[:rows]), rows


def test_what_the_kernel_cannot_serve_stays_a_linear():
    assert PackedLinear.from_linear(nn.Linear(32, 16).to(torch.bfloat16)) is None
    net = nn.Sequential(nn.Linear(32, 32), nn.Sequential(nn.Linear(32, 16, bias=False)), nn.Linear(16, 8))
    keep = net[2]
    swapped, kept = to_packed_linears_(net, skip=(keep,))
    assert kept == 0 or not packed_kernel_available()
    assert swapped == (2 if packed_kernel_available() else 0)
    assert net[2] is keep and isinstance(net[2], nn.Linear)


def test_packed_layout_is_a_cpu_layout_chosen_once():
    assert resolve_layout("packed", "cpu") == "packed"
    with pytest.raises(ValueError, match="packed"):
        resolve_layout("packed", "cuda:0")
    model = init_random_(StageModel(tiny_cfg("qwen2"), range(2), embedding=True, head=True)).eval()
    set_weight_layout_(model, "packed", skip=(model.output_layer,))
    assert isinstance(model.output_layer, nn.Linear)  # skipped: the head screen gathers its rows
    if packed_kernel_available():  # without oneDNN nothing was packed (every linear went column-major)
        with pytest.raises(ValueError, match="packed already"):
            set_weight_layout_(model, "col")


@needs_kernel
@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: Q, K, V biases go with the packed weight
def test_packed_layout_decodes_what_col_does_up_to_rounding(arch):
    ecfg = tiny_engine_config(arch, weight_layout="packed")
    layers = range(ecfg.model.cfg.num_layers)
    packed = build_stage_model(ecfg, layers, embedding=True, head=True)
    col = build_stage_model(ecfg.replace(weight_layout="col"), layers, embedding=True, head=True)
    assert isinstance(packed.decoder.layers["0"].mlp.linear_fc1, PackedLinear)
    pdm = build_pdm(ecfg)  # the PDM's weights are read as tensors: never packed
    assert not any(isinstance(m, PackedLinear) for m in pdm.modules())
    with torch.no_grad():
        h = torch.randn(1, 5, ecfg.model.cfg.hidden_size)
        a, _ = packed.forward_layers(h, packed.new_cache(1, 8), 0)
        b, _ = col.forward_layers(h, col.new_cache(1, 8), 0)
    assert torch.allclose(a, b, atol=1e-5, rtol=1e-5), (a - b).abs().max()
    prompt = list(range(3, 20))
    want = greedy_generate(col, prompt, 24)
    got = greedy_generate(packed, prompt, 24)
    assert_greedy_agrees(got, want, teacher_forced(col, prompt, want), 1e-4, f"{arch} packed vs col")


@needs_kernel
def test_mixed_sends_one_row_through_the_column_major_copy():
    """`mixed`: one row is exactly what the col layout computes, several rows exactly the packed kernel's."""
    torch.manual_seed(3)
    lin = nn.Linear(64, 48)
    mixed, packed = PackedLinear.from_linear(lin, keep_dense=True), PackedLinear.from_linear(lin)
    col = nn.Linear(64, 48)
    col.load_state_dict(lin.state_dict())
    set_weight_layout_(col, "col")
    x = torch.randn(1, 1, 64)
    assert torch.equal(mixed(x), col(x))
    xs = torch.randn(1, 5, 64)
    assert torch.equal(mixed(xs), packed(xs))


@needs_kernel
def test_state_dict_keeps_the_linear_names_and_values():
    """A packed model saves and loads as the nn.Linear one (train/ copies target layers into heads)."""
    model = init_random_(StageModel(tiny_cfg("qwen2"), range(2), embedding=True, head=True)).eval()
    want = {k: v.clone() for k, v in model.state_dict().items()}
    set_weight_layout_(model, "mixed", skip=(model.output_layer,))
    got = model.state_dict()
    assert list(got) == list(want) and all(torch.equal(got[k], want[k]) for k in want)
    other = init_random_(StageModel(tiny_cfg("qwen2"), range(2), embedding=True, head=True), seed=5).eval()
    set_weight_layout_(other, "mixed", skip=(other.output_layer,))
    other.load_state_dict(want)
    h = torch.randn(1, 3, other.cfg.hidden_size)
    with torch.no_grad():
        a, _ = other.forward_layers(h, other.new_cache(1, 4), 0)
        b, _ = model.forward_layers(h, model.new_cache(1, 4), 0)
    assert torch.equal(a, b)  # reloaded weights, repacked: the same kernel on the same values
    bad = dict(want)
    bad["decoder.layers.0.mlp.linear_fc1.weight"] = torch.zeros(3, 3)
    with pytest.raises(RuntimeError, match="size mismatch"):
        other.load_state_dict(bad)

"""The linear weights' memory layout (engine/model/linear.py): the same values in another layout,
applied by the builders to what a run computes with, part of what names a cached reference, and
outputs that agree with the row layout up to float rounding (another BLAS kernel), and the runtime
lossless in each layout (the other tests' tiny runs use row-major weights: tests/engine/helpers.py)."""
from __future__ import annotations

import pytest
import torch
from helpers import Policy, check_run, random_prompts, reference, tiny_cfg, tiny_engine_config
from near_ties import assert_greedy_agrees, teacher_forced

from spd_engine.engine.model.greedy import greedy_generate
from spd_engine.engine.model.linear import is_col_major, resolve_layout, set_weight_layout_
from spd_engine.engine.model.model import StageModel, init_random_
from spd_engine.engine.runtime.batch_driver import BatchRequest
from spd_engine.engine.runtime.build import build_pdm, build_stage_model
from spd_engine.engine.runtime.reference import ReferenceExecutor
from spd_engine.engine.runtime.run_config import RunConfig
from spd_engine.kernels.packed_linear import packed_kernel_available
from spd_engine.train.reference_cache import ReferenceCache


def test_resolve_layout():
    auto = ("packed", "packed") if packed_kernel_available() else ("col", "col")  # mixed: not batch-invariant
    assert (resolve_layout("auto", "cpu", threads=2), resolve_layout("auto", "cpu", threads=1)) == auto
    assert resolve_layout("auto", "cuda:0") == "row"
    assert resolve_layout("row", "cpu") == "row" and resolve_layout("col", "cuda") == "col"
    with pytest.raises(ValueError, match="weight layout"):
        resolve_layout("diagonal", "cpu")
    with pytest.raises(ValueError, match="weight layout"):
        tiny_engine_config(weight_layout="columns")


def test_set_weight_layout_keeps_values_names_and_parameters():
    model = init_random_(StageModel(tiny_cfg("qwen2"), range(2), embedding=True, head=True)).eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    params = dict(model.named_parameters())
    out = model.output_layer
    moved = set_weight_layout_(model, "col", skip=(out,))
    assert moved == 8  # qkv, proj, fc1, fc2 of 2 layers; the skipped output layer stays
    after = model.state_dict()
    assert list(after) == list(before) and all(torch.equal(after[k], before[k]) for k in before)
    assert all(params[k] is p for k, p in model.named_parameters())  # the Parameters stay (optimizers, hooks)
    layer = model.decoder.layers["0"]
    assert is_col_major(layer.mlp.linear_fc1.weight) and is_col_major(layer.self_attention.linear_qkv.weight)
    assert not is_col_major(out.weight) and out.weight.is_contiguous()
    assert set_weight_layout_(model, "col", skip=(out,)) == 0  # already there
    assert set_weight_layout_(model, "row") == 8
    assert layer.mlp.linear_fc1.weight.is_contiguous()
    with pytest.raises(ValueError, match="weight layout"):
        set_weight_layout_(model, "auto")


def test_bf16_weights_keep_torch_layout():
    model = init_random_(StageModel(tiny_cfg("llama"), range(1))).to(torch.bfloat16)
    assert set_weight_layout_(model, "col") == 0
    assert model.decoder.layers["0"].mlp.linear_fc1.weight.is_contiguous()


def test_builders_apply_the_run_layout():
    ecfg = tiny_engine_config("llama", weight_layout="col")
    assert ecfg.resolved_weight_layout == "col"
    stage = build_stage_model(ecfg, range(2), embedding=True, head=True)
    assert is_col_major(stage.decoder.layers["1"].mlp.linear_fc2.weight)
    pdm = build_pdm(ecfg)  # fp32 in the tests' config
    assert is_col_major(pdm.head.weight) and is_col_major(pdm.stack.decoder.layers["0"].mlp.linear_fc1.weight)
    row = build_stage_model(ecfg.replace(weight_layout="row"), range(2), embedding=True, head=True)
    assert row.decoder.layers["1"].mlp.linear_fc2.weight.is_contiguous()


def test_reference_cache_names_the_layout(tmp_path):
    ecfg = tiny_engine_config("llama", weight_layout="auto")
    keys = {lay: ReferenceCache(tmp_path, ecfg.replace(weight_layout=lay)).key([1, 2], 8, [0], 4)
            for lay in ("row", "col", "packed", "mixed", "auto")}
    assert len({keys["row"], keys["col"], keys["packed"], keys["mixed"]}) == 4
    assert keys["auto"] == keys[ecfg.resolved_weight_layout]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_col_layout_decodes_what_row_does_up_to_rounding(arch):
    """Another kernel, so not bit for bit: logits within fp32 rounding, greedy tokens equal up to the
    first near-tie (tests/near_ties.py)."""
    ecfg: RunConfig = tiny_engine_config(arch, weight_layout="col")
    col = build_stage_model(ecfg, range(ecfg.model.cfg.num_layers), embedding=True, head=True)
    row = build_stage_model(ecfg.replace(weight_layout="row"), range(ecfg.model.cfg.num_layers),
                            embedding=True, head=True)
    prompt = list(range(3, 20))
    with torch.no_grad():
        h = torch.randn(1, 5, ecfg.model.cfg.hidden_size)
        a, _ = col.forward_layers(h, col.new_cache(1, 8), 0)
        b, _ = row.forward_layers(h, row.new_cache(1, 8), 0)
    assert torch.allclose(a, b, atol=1e-5, rtol=1e-5), (a - b).abs().max()
    want = greedy_generate(row, prompt, 24)
    got = greedy_generate(col, prompt, 24)
    assert_greedy_agrees(got, want, teacher_forced(row, prompt, want), 1e-4, f"{arch} col vs row")


@pytest.mark.parametrize("layout", ["col"] + (["packed", "mixed"] if packed_kernel_available() else []))
def test_spd_is_lossless_in_every_weight_layout(layout, one_thread):
    """The runtime over each other layout (packed is auto's choice on a CPU with oneDNN), n = 2 and
    n = 4 co-located: oracle drafts with and without forced rejections and the untrained PDM's own,
    token for token against greedy decoding in that layout, ticks by the formula; two requests at
    once draw their lone tokens where the probe finds the layout's steps row-invariant (mixed never)."""
    new = 32
    for n, colocate in ((2, False), (4, True)):
        ecfg = tiny_engine_config("llama", n, colocate, weight_layout=layout)
        prompts = random_prompts(ecfg.model.cfg, (5, 23), seed=1)
        refs = [reference(ecfg, p, new) for p in prompts]
        with ReferenceExecutor(ecfg) as ex:
            for p, ref, wrong in zip(prompts, refs, (frozenset(), frozenset({1, 2, 20, new - 1}))):
                policy = Policy(ref, len(p), ecfg.model.cfg.vocab_size, wrong=wrong)
                check_run(ex.generate(p, new, (), draft_policy=policy), ref, policy, n)
            assert ex.generate(prompts[0], 16).tokens == refs[0][:16]
            report = build_stage_model(ecfg, range(ecfg.model.cfg.num_layers), embedding=True,
                                       head=True).row_invariance
            if report.invariant and report.max_rows >= 2:
                out = ex.generate_batch([BatchRequest(p, new, ()) for p in prompts], 2)
                assert [r.tokens for r in out.results] == refs, (layout, n)

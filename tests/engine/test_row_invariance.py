"""Batch invariance (engine/model/row_invariance.py): a request's row of a stage step, of the LM head
and of the PDM pass has the same bits alone as beside one or two other requests' rows, in every
weight layout the builders can make row-invariant; the probe finds the floor a kernel needs, and
refuses one that no floor fixes."""
from __future__ import annotations

import pytest
import torch
from helpers import tiny_engine_config

from spd_engine.engine.model.kv_cache import RowCaches
from spd_engine.engine.model.row_invariance import MAX_FLOOR, PROBE_ROWS, probe_rows
from spd_engine.engine.runtime.build import build_pdm, build_stage_model
from spd_engine.kernels.int8_linear import int8_kernel_available
from spd_engine.kernels.packed_linear import packed_kernel_available

LAYOUTS = ["row", "col"] + (["packed"] if packed_kernel_available() else [])
PROMPTS = [[5, 9, 2, 7], [7, 1, 4, 4, 8, 3, 6], [11, 2]]  # three requests at three lengths
NEXT = [13, 17, 19]


def test_probe_finds_the_floor_a_kernel_needs_and_its_ceiling():
    # the made-up kernels below round by row count only where they say so: the host's own matmul may
    # not be row-invariant at this shape (MKL on an AVX2-only AMD host: rows 4 .. 7 agree), so none is used
    def one_row_apart(x: torch.Tensor) -> torch.Tensor:  # another kernel for one row (a matrix-vector pass)
        return 3.0 * x + (1e-3 if x.shape[0] == 1 else 0.0)

    def blocks_of_9(x: torch.Tensor) -> torch.Tensor:  # and another from 10 rows on
        return one_row_apart(x) + (1e-3 if x.shape[0] >= 10 else 0.0)

    def by_rows(x: torch.Tensor) -> torch.Tensor:  # every row count rounds otherwise
        return 3.0 * x + 1e-3 * x.shape[0]

    assert probe_rows(lambda x: 3.0 * x, 16, torch.float32, "cpu") == (1, PROBE_ROWS)  # no sum over a row
    assert probe_rows(one_row_apart, 16, torch.float32, "cpu") == (2, PROBE_ROWS)
    assert probe_rows(blocks_of_9, 16, torch.float32, "cpu") == (2, 9)
    assert probe_rows(by_rows, 16, torch.float32, "cpu") == (MAX_FLOOR, MAX_FLOOR)  # all padded to the floor


def _needs_invariance(report, rows: int) -> None:
    """The bit-identity below is what the probe promises where it finds the kernels row-invariant; a CPU
    whose BLAS rounds every row count otherwise (the runtime then says so) is skipped, naming why."""
    if not (report.invariant and report.max_rows >= rows):
        pytest.skip(f"this CPU's kernels are not row-invariant up to {rows} rows here: {report}")


def _stage_rows(model, caches, which: list[int]) -> torch.Tensor:
    """One decode row of each request in `which`, in one step -> outputs [len(which), H]."""
    starts = [len(PROMPTS[i]) for i in which]
    h = model.embed(torch.tensor([[NEXT[i] for i in which]]))  # [1, R, H]
    if len(which) == 1:  # a lone request: the plain cache path, as a one-request run steps it
        out, _ = model.forward_layers(h, caches[which[0]], starts[0])
    else:
        out, _ = model.forward_layers(h, RowCaches([caches[i] for i in which], starts), 0,
                                      positions=torch.tensor([starts]))
    return out[0]


@pytest.mark.parametrize("layout", LAYOUTS)
@torch.no_grad()
def test_a_stage_row_and_its_logits_are_the_same_alone_and_in_a_batch(layout, one_thread):
    ecfg = tiny_engine_config("llama", weight_layout=layout)
    model = build_stage_model(ecfg, range(ecfg.model.cfg.num_layers), embedding=True, head=True)
    _needs_invariance(model.row_invariance, 3)
    outs = []
    for which in ([0], [0, 1], [0, 1, 2], [2, 0]):
        caches = [model.new_cache(1, 32) for _ in PROMPTS]
        for cache, ids in zip(caches, PROMPTS):  # the same prefill for every request
            model.forward_layers(model.embed(torch.tensor([ids])), cache, 0)
        outs.append(dict(zip(which, _stage_rows(model, caches, which))))
    for got in outs[1:]:
        for i, row in got.items():
            if i in outs[0] or i in outs[1]:
                assert torch.equal(row, (outs[0] if i in outs[0] else outs[1])[i]), (layout, i)
    rows = torch.stack([outs[2][i] for i in range(3)])  # [3, H]
    logits = model.logits_rows(rows)
    assert all(torch.equal(logits[i], model.logits(rows[i])) for i in range(3))


@pytest.mark.parametrize("pdm_dtype", ["float32"] + (["int8"] if int8_kernel_available() else []))
@pytest.mark.parametrize("layout", LAYOUTS)
@torch.no_grad()
def test_a_request_s_pdm_rows_are_the_same_alone_and_in_a_batch(layout, pdm_dtype, one_thread):
    ecfg = tiny_engine_config("llama", weight_layout=layout, pdm_dtype=pdm_dtype)
    pdm = build_pdm(ecfg)
    _needs_invariance(pdm.row_invariance, 4)
    H = ecfg.model.cfg.hidden_size
    gen = torch.Generator().manual_seed(3)
    rows = [torch.randn(c, H, generator=gen) for c in (1, 2, 3)]  # a request's rows of a tick: 1 to 3
    starts = [4, 6, 3]

    def run(which: list[int]) -> list[torch.Tensor]:
        caches = [pdm.new_cache(32) for _ in rows]
        for cache, s in zip(caches, starts):  # each request's earlier rows
            pdm.forward_rows(torch.randn(1, s, H, generator=torch.Generator().manual_seed(s)), cache, 0)
        if len(which) == 1:
            i = which[0]
            return [pdm.forward_rows(rows[i][None], caches[i], starts[i])[0]]
        x = torch.cat([rows[i] for i in which])[None]
        spans = RowCaches([caches[i] for i in which], [starts[i] for i in which], [len(rows[i]) for i in which])
        pos = spans.positions()
        return list(pdm.forward_rows(x, spans, 0, positions=pos)[0].split(spans.counts))

    alone = [run([i])[0] for i in range(3)]
    for which in ([0, 1], [1, 2], [0, 1, 2], [2, 0]):
        if sum(len(rows[i]) for i in which) > pdm.row_invariance.max_rows:
            continue  # past the probed ceiling (tiny row-major shapes on one host: 5 rows)
        for i, got in zip(which, run(which)):
            assert torch.equal(got, alone[i]), (layout, pdm_dtype, which, i)
    logits = [pdm.draft_logits(a[-1]) for a in alone]  # the draft head on one row and on three
    both = pdm.draft_logits(torch.stack([a[-1] for a in alone]))
    assert all(torch.equal(both[i], logits[i]) for i in range(3))


@torch.no_grad()
def test_anchor_rows_are_the_same_for_any_row_count(one_thread):
    ecfg = tiny_engine_config("llama", weight_layout="col")
    pdm = build_pdm(ecfg)
    ring = torch.randn(8, len(pdm.pcfg.anchors), ecfg.model.cfg.hidden_size)
    slots, types = torch.tensor([3, 1, 6]), torch.tensor([pdm.plan.num_types - 1, 0, 0])
    three = pdm.rows_from_ring(ring, slots, types)
    assert all(torch.equal(pdm.rows_from_ring(ring, slots[i:i + 1], types[i:i + 1])[0], three[i]) for i in range(3))


@pytest.mark.skipif(not packed_kernel_available(), reason="oneDNN's packed layout")
def test_mixed_layout_is_reported_not_batch_invariant(one_thread):
    ecfg = tiny_engine_config("llama", weight_layout="mixed")
    model = build_stage_model(ecfg, range(ecfg.model.cfg.num_layers), embedding=True, head=True)
    # mixed steps one row through a column-major copy and several through the packed weight: where those two
    # kernels round a row differently (every host measured), the probe must say the layout is not invariant
    fc1 = model.get_submodule("decoder.layers.0.mlp.linear_fc1")
    x = torch.randn(2, ecfg.model.cfg.hidden_size)
    if torch.equal(fc1(x[:1]), fc1(x)[:1]):
        pytest.skip("on this CPU mixed's one-row and several-row kernels round alike")
    assert not model.row_invariance.invariant and "decoder.layers.0.mlp.linear_fc1" in model.row_invariance.variant


@pytest.mark.parametrize("layout", LAYOUTS)
@torch.no_grad()
def test_a_multi_token_entry_is_the_same_alone_and_beside_another_request(layout, one_thread):
    """A suffix run's entry (several rows of one request, causal among themselves) in a step with
    another request's row: its rows' bits are the lone step's."""
    ecfg = tiny_engine_config("llama", weight_layout=layout)
    model = build_stage_model(ecfg, range(ecfg.model.cfg.num_layers), embedding=True, head=True)
    run, other = [13, 21, 8], [17]

    def fresh():
        caches = [model.new_cache(1, 32) for _ in PROMPTS[:2]]
        for cache, ids in zip(caches, PROMPTS):
            model.forward_layers(model.embed(torch.tensor([ids])), cache, 0)
        return caches

    alone, _ = model.forward_layers(model.embed(torch.tensor([run])), fresh()[0], len(PROMPTS[0]))
    starts = [len(PROMPTS[0]), len(PROMPTS[1])]
    spans = RowCaches(fresh(), starts, [len(run), 1])
    both, _ = model.forward_layers(model.embed(torch.tensor([run + other])), spans, 0, positions=spans.positions())
    assert torch.equal(both[0, :len(run)], alone[0])

"""A stage step over one token of each of several requests (engine/model/kv_cache.py RowCaches)
against the plain reference: each request stepped alone on its own cache."""
from __future__ import annotations

import pytest
import torch
from helpers import ARCHS, tiny_cfg

from spd_engine.engine.model.kv_cache import RowCaches
from spd_engine.engine.model.model import StageModel, init_random_

pytestmark = pytest.mark.pure


def _prefilled(model: StageModel, prompts: list[list[int]]):
    caches = [model.new_cache(1, 64) for _ in prompts]
    for cache, ids in zip(caches, prompts):
        model.forward_layers(model.embed(torch.tensor([ids])), cache, 0)
    return caches


@pytest.mark.parametrize("arch", ARCHS)
def test_rows_of_several_requests_equal_each_request_alone(arch):
    torch.manual_seed(0)
    cfg = tiny_cfg(arch)
    model = init_random_(StageModel(cfg, range(cfg.num_layers), embedding=True), seed=1)
    prompts = [[5, 9, 2], [7, 1, 4, 4, 8, 3, 6], [11]]  # three requests at three lengths
    nxt = [13, 17, 19]
    alone_caches, rows_caches = _prefilled(model, prompts), _prefilled(model, prompts)
    want, want_caps = [], []
    for cache, ids, tok in zip(alone_caches, prompts, nxt):
        out, caps = model.forward_layers(model.embed(torch.tensor([[tok]])), cache, len(ids), capture=frozenset({0}))
        want.append(out[0, 0])
        want_caps.append(caps[0][0, 0])
    positions = [len(p) for p in prompts]
    h = model.embed(torch.tensor([nxt]))  # [1, R, H]
    out, caps = model.forward_layers(h, RowCaches(rows_caches, positions), 0,
                                     positions=torch.tensor([positions]), capture=frozenset({0}))
    torch.testing.assert_close(out[0], torch.stack(want), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(caps[0][0], torch.stack(want_caps), rtol=1e-5, atol=1e-5)
    for a, b, ids in zip(alone_caches, rows_caches, prompts):  # each request's cache got its own entry
        for layer in model.layer_range:
            torch.testing.assert_close(b.k[layer][:, :, :len(ids) + 1], a.k[layer][:, :, :len(ids) + 1])
            assert not b.k[layer][:, :, len(ids) + 1:].any()


def test_a_position_past_a_cache_is_refused():
    cfg = tiny_cfg("llama")
    model = StageModel(cfg, range(cfg.num_layers))
    with pytest.raises(ValueError, match="holds 8 positions; writing at 8"):
        RowCaches([model.new_cache(1, 8)], [8])


@pytest.mark.parametrize("rows", [1, 2, 3, 5])
def test_logits_of_several_rows_equal_each_row_alone(rows):
    cfg = tiny_cfg("qwen2")
    model = init_random_(StageModel(cfg, range(cfg.num_layers), head=True), seed=2)
    h = torch.randn(rows, cfg.hidden_size)
    got = model.logits_rows(h)
    assert got.shape == (rows, cfg.vocab_size)
    torch.testing.assert_close(got, torch.stack([model.logits(row) for row in h]), rtol=1e-5, atol=1e-5)


def test_spans_of_several_rows_equal_each_request_alone():
    """The PDM's pass over every request's rows: request i's rows are consecutive positions, causal
    among themselves, on its own cache."""
    torch.manual_seed(1)
    cfg = tiny_cfg("qwen3")
    model = init_random_(StageModel(cfg, range(cfg.num_layers)), seed=3)
    lengths, counts = [4, 9, 1], [2, 1, 3]
    alone_caches = [model.new_cache(1, 32) for _ in lengths]
    span_caches = [model.new_cache(1, 32) for _ in lengths]
    for a, b, L in zip(alone_caches, span_caches, lengths):
        h0 = torch.randn(1, L, cfg.hidden_size)
        model.forward_layers(h0, a, 0)
        model.forward_layers(h0, b, 0)
    rows = [torch.randn(1, c, cfg.hidden_size) for c in counts]
    want = [model.forward_layers(r, cache, L)[0][0] for r, cache, L in zip(rows, alone_caches, lengths)]
    spans = RowCaches(span_caches, lengths, counts)
    got, _ = model.forward_layers(torch.cat(rows, dim=1), spans, 0, positions=spans.positions())
    torch.testing.assert_close(got[0], torch.cat(want), rtol=1e-5, atol=1e-5)

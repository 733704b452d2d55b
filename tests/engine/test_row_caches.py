"""A stage step over one token of each of several requests (engine/model/kv_cache.py RowCaches)
against the plain reference: each request stepped alone on its own cache."""
from __future__ import annotations

import pytest
import torch

from spd_engine.engine.model.kv_cache import RowCaches
from spd_engine.engine.model.model import StageModel, init_random_
from helpers import ARCHS, tiny_cfg

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

"""The tree-step shape of branch width W (bench/stage_width_time.py): W sibling tokens at one position,
each seeing the shared prefix and itself, give each token's own single-token step."""
from __future__ import annotations

import copy

import pytest
import torch

from spd_engine.bench.stage_width_time import main, time_widths, tree_mask
from spd_engine.engine.model.model import StageModel, init_random_
from spd_engine.engine.model.model_config import tiny_config


def test_tree_mask():
    m = tree_mask(2, 3)
    assert m.shape == (3, 5) and m[:, :2].all() and torch.equal(m[:, 2:], torch.eye(3, dtype=torch.bool))


@torch.no_grad()
def test_siblings_in_one_step_equal_their_own_steps():
    cfg = tiny_config("llama", num_layers=2)
    stage = init_random_(StageModel(cfg, range(2)), seed=1).eval()
    P, W = 7, 3
    cache = stage.new_cache(1, P + W)
    stage.forward_layers(torch.randn(1, P, cfg.hidden_size), cache, 0)  # the shared prefix
    siblings = torch.randn(1, W, cfg.hidden_size)  # [1, W, H]
    alone = []
    for i in range(W):
        own = copy.deepcopy(cache)
        alone.append(stage.forward_layers(siblings[:, i:i + 1], own, P, torch.full((1, 1), P))[0][0, 0])
    tree, _ = stage.forward_layers(siblings, cache, P, torch.full((1, W), P), tree_mask(P, W))
    assert torch.allclose(tree[0], torch.stack(alone), atol=1e-5)


def test_timing_runs_and_refuses_bad_widths(capsys):
    t = time_widths("tiny-llama", 1, (1, 2), prefix=8, iters=3, warmup=1, layouts=("row", "col"))
    assert set(t) == {("row", 1), ("row", 2), ("col", 1), ("col", 2)} and all(v > 0 for v in t.values())
    assert main(["--preset", "tiny-llama", "--layers", "1", "--widths", "1,2", "--prefix", "8",
                 "--layouts", "row,col"]) == 0
    out = capsys.readouterr().out
    assert "row W=2" in out and "col W=1" in out
    with pytest.raises(SystemExit):
        main(["--widths", "2,4"])
    with pytest.raises(SystemExit):
        main(["--layouts", "diagonal"])

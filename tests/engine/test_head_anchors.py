"""A trained head's anchors and split (engine/model/pdm.py check_pdm_matches, RunConfig.plan): the
runtime reads the states the head's projections were trained on, even where they are not the
split's defaults, and a head serves another split of its n when its anchors select the same type
at every depth (its drafts are then the same); other splits are refused by name."""
from __future__ import annotations

import pytest
from helpers import random_prompts, reference, tiny_cfg, tiny_engine_config

from spd_engine.engine.model.pdm import check_pdm_matches, random_pdm, save_pdm
from spd_engine.engine.protocol.anchors import default_anchors
from spd_engine.engine.protocol.topology import Topology
from spd_engine.engine.runtime.reference import ReferenceExecutor

NEW = 24


@pytest.fixture(scope="module")
def head(tmp_path_factory):
    """An n=3 head over the 6-layer tiny llama with anchors 0, 1, 5 (the defaults at 2/2/2 are
    0, 2, 5), trained-looking: its K=1 layer and projections random."""
    cfg = tiny_cfg("llama")
    assert default_anchors([0, 2, 4, 6]) != (0, 1, 5)
    pdm = random_pdm(cfg, (2, 2, 2), num_layers=1, seed=5, anchors=(0, 1, 5))
    return save_pdm(pdm, tmp_path_factory.mktemp("heads") / "n3"), pdm.pcfg


def test_the_runtime_reads_the_heads_own_anchors(head, one_thread):
    path, pcfg = head
    ecfg = tiny_engine_config("llama", 3, pdm=str(path))
    assert ecfg.plan().anchors == pcfg.anchors == (0, 1, 5)
    prompt = random_prompts(ecfg.model.cfg, [11], seed=4)[0]
    with ReferenceExecutor(ecfg) as ex:
        res = ex.generate(prompt, NEW)
    assert res.tokens == reference(ecfg, prompt, NEW)


def test_a_head_serves_a_split_with_the_same_types_per_depth(head, one_thread):
    path, pcfg = head
    cfg = tiny_cfg("llama")
    moved = check_pdm_matches(pcfg, cfg, (1, 3, 2))  # anchor 1 still in stage 0, anchor 5 in the last stage
    assert moved.stage_layers == (1, 3, 2) and moved.anchors == pcfg.anchors
    assert moved.plan().depth_types == pcfg.plan().depth_types
    ecfg = tiny_engine_config("llama", 3, pdm=str(path)).replace(topology=Topology.build(6, stage_layers=[1, 3, 2]))
    prompt = random_prompts(ecfg.model.cfg, [11], seed=4)[0]
    with ReferenceExecutor(ecfg) as ex:
        moved_run = ex.generate(prompt, NEW)
    with ReferenceExecutor(tiny_engine_config("llama", 3, pdm=str(path))) as ex:
        trained_run = ex.generate(prompt, NEW)
    assert moved_run.tokens == trained_run.tokens == reference(ecfg, prompt, NEW)
    assert (moved_run.ticks, moved_run.accepted) == (trained_run.ticks, trained_run.accepted)  # the same drafts


@pytest.mark.parametrize("split", [(2, 3, 1), (1, 4, 1), (2, 4), (3, 3)])  # anchor 5 reached at depth 2; another n
def test_other_splits_are_refused_by_name(head, split):
    _, pcfg = head
    with pytest.raises(ValueError, match=r"trained for n=3 stages with layers \[2, 2, 2\]"):
        check_pdm_matches(pcfg, tiny_cfg("llama"), split)

"""The training simulation computes exactly what the runtime's driver computes.

Tiny model, K=2 PDM layers, stage split 2,2,1,1 (anchors {0,2,5}: depths 1 and 2 share a type,
and so do 3 and 4), fills 1..n all exercised (after prefill the pipeline fills one tick at a time).
"""
from __future__ import annotations

import pytest
import torch

from spd_engine.engine.model.greedy import greedy_generate
from spd_engine.engine.protocol.topology import Topology
from spd_engine.engine.runtime.build import build_pdm, build_stage_model
from spd_engine.engine.runtime.reference import ReferenceExecutor
from spd_engine.engine.runtime.run_config import PRESETS, Drafting, ModelSpec, ParallelLayout, RunConfig, Runtime
from spd_engine.train.pipeline_sim import block_depths, simulated_hidden, simulation_mask, target_anchors

TOL = 1e-5  # fp32: different shapes and reduction orders, measured max |diff| ~6e-7


def _setup(rejections: bool):
    cfg = PRESETS["tiny-llama"]
    ecfg = RunConfig(model=ModelSpec(source="random:tiny-llama", cfg=cfg),
                     parallel=ParallelLayout(topology=Topology.build(cfg.num_layers, stage_layers="2,2,1,1")),
                     drafting=Drafting(pdm_layers=2, pdm_dtype="float32"),  # exact comparisons: the PDM in fp32 on every CPU
                     runtime=Runtime(capacity=128, timeout_s=10, prefill_chunk=8))
    plan = ecfg.plan()
    assert plan.depth_types == (0, 1, 1, 2, 2)  # two pairs of depths share a type
    full = build_stage_model(ecfg, range(cfg.num_layers), True, True)
    pdm = build_pdm(ecfg)
    prompt = list(range(5, 22))
    ref = greedy_generate(full, prompt, 24, chunk=8)
    P = len(prompt)
    seen: list[tuple[int, int, torch.Tensor]] = []
    # oracle drafts, except forced misses at two positions when testing refills
    bad = {P + 6, P + 13} if rejections else set()

    def policy(pos: int, draft: int) -> int:
        if pos - P >= len(ref):
            return draft
        return (ref[pos - P] + 1) % cfg.vocab_size if pos in bad else ref[pos - P]

    with ReferenceExecutor(ecfg, pdm=pdm) as ex:
        ex.driver.draft_observer = lambda pos, f, logits: seen.append((pos, f, logits.clone()))
        out = ex.generate(prompt, 24, (), draft_policy=policy)
    assert out.tokens == ref
    seq = torch.tensor([prompt + ref])
    anchors, _ = target_anchors(full, plan, seq)
    with torch.no_grad():
        sim = {f: pdm.draft_logits(simulated_hidden(pdm, anchors, f))[0] for f in range(1, plan.n + 1)}
    return seen, sim, seq, P, bad


@pytest.mark.parametrize("rejections", [False, True])
def test_simulation_matches_driver(rejections):
    seen, sim, seq, P, bad = _setup(rejections)
    fills = set()
    compared = 0
    for pos, f, logits in seen:
        # only ticks whose in-flight tokens are all reference tokens are teacher-forceable
        if pos >= seq.shape[1] or any(b <= pos for b in bad if pos - b < 4):
            continue
        assert (sim[f][pos] - logits).abs().max().item() < TOL, (pos, f)
        fills.add(f)
        compared += 1
    assert fills == {1, 2, 3, 4}
    assert compared >= 15


def per_type_hidden(pdm, anchors: torch.Tensor, f: int) -> torch.Tensor:
    """The per-aggregation-type layout (one block per type instead of per depth): a row of type a
    stands for the shallowest depth of that type, so depths sharing a type share one key chain."""
    plan, n = pdm.plan, pdm.plan.n
    S = anchors.shape[1]
    depths = block_depths(n, f)
    types = sorted({plan.type_at_depth(d) for d in depths})
    rep = {a: min(d for d in depths if plan.type_at_depth(d) == a) for a in types}
    rows = torch.cat([pdm.rows_of_type(anchors, a) for a in types], dim=1)
    qa = torch.tensor(types).repeat_interleave(S)
    qt = torch.arange(S).repeat(len(types))
    qd = torch.tensor([rep[int(a)] for a in qa])
    lag = (qd[:, None] + qt[:, None] - qt[None, :]).clamp(min=0)
    want_d = torch.where(lag < f, lag, torch.full_like(lag, n))
    want_a = torch.tensor([plan.type_at_depth(int(d)) for d in want_d.flatten()]).view_as(want_d)
    mask = (qt[None, :] <= qt[:, None]) & (qa[None, :] == want_a)
    pos = qt[None].expand(anchors.shape[0], -1)
    h = pdm.forward_rows(rows, pdm.new_cache(rows.shape[1], batch=anchors.shape[0]), 0, positions=pos,
                         mask=mask[None, None])
    return h[:, :S]


def test_per_type_layout_is_not_exact_for_k2():
    """With K=2 and depths sharing a type (2,2,1,1), the per-type layout misses the driver's
    drafts while the per-depth block layout matches them: the construction is what makes it exact."""
    cfg = PRESETS["tiny-llama"]
    ecfg = RunConfig(model=ModelSpec(source="random:tiny-llama", cfg=cfg),
                     parallel=ParallelLayout(topology=Topology.build(cfg.num_layers, stage_layers="2,2,1,1")),
                     drafting=Drafting(pdm_layers=2, pdm_dtype="float32"),  # exact comparisons: the PDM in fp32 on every CPU
                     runtime=Runtime(capacity=128, timeout_s=10, prefill_chunk=8))
    seen, sim, seq, _, _ = _setup(False)
    pdm = build_pdm(ecfg)
    full = build_stage_model(ecfg, range(cfg.num_layers), True, True)
    anchors, _ = target_anchors(full, ecfg.plan(), seq)
    with torch.no_grad():
        naive = pdm.draft_logits(per_type_hidden(pdm, anchors, 4))[0]
    worst = max((naive[t] - lg).abs().max().item() for t, f, lg in seen if f == 4 and t < seq.shape[1])
    exact = max((sim[4][t] - lg).abs().max().item() for t, f, lg in seen if f == 4 and t < seq.shape[1])
    assert exact < TOL and worst > 1e-3, (exact, worst)


def test_mask_shape_and_self_attention():
    for n in (1, 2, 4):
        for f in range(1, n + 1):
            m = simulation_mask(7, n, f)
            nb = len(block_depths(n, f))
            assert m.shape == (nb * 7, nb * 7)
            assert bool(m.diagonal().all())  # every row sees itself
    with pytest.raises(ValueError):
        block_depths(4, 0)

"""Branch width W in the runtime (docs/design.md 3.11), on the reference executor (the driver and
stage workers of a distributed run, in one process): greedy outputs equal greedy decoding for
W in {2, 4} over n = 1..4, co-located, an uneven split and the static step mode; branch points
whose target token is a later candidate are saved, and the tick count is the tick protocol's
for the same verdicts; at T>0 a seed fixes the output.

A chain step computes W rows in one matmul, another computation than greedy's one-token steps
(docs/testing.md, case 2): its outputs equal greedy decoding up to a near-tie. `agrees` asserts
equality or a divergence at a near-tie (none met on the hosts these ran on), and the checks that
need the reference's tokens (tick counts) apply where the outputs are equal."""
from __future__ import annotations

import pytest
from helpers import Policy, full_model, random_prompts, reference, tiny_cfg, tiny_engine_config
from near_ties import assert_greedy_agrees, teacher_forced

from spd_engine.engine.protocol.branching import BranchPolicy
from spd_engine.engine.protocol.sampling import SamplingParams
from spd_engine.engine.protocol.tick import Draft, TickState, Verdict
from spd_engine.engine.protocol.topology import Topology
from spd_engine.engine.runtime.reference import ReferenceExecutor

NEW = 40
CHAIN_LOGIT_BOUND = 1e-5  # W-row vs one-token steps on the tiny configs (logits O(1)), as static vs eager


def agrees(ecfg, prompt: list[int], got: list[int], want: list[int]) -> bool:
    """The run's tokens equal greedy decoding's, or first differ at a near-tie; True when equal."""
    k = assert_greedy_agrees(got, want, teacher_forced(full_model(ecfg), prompt, want), CHAIN_LOGIT_BOUND,
                             f"W={ecfg.drafting.branches}")
    if k is not None:
        print(f"near-tie at token {k}: outputs part there (allowed)")
    return k is None
WRONG = frozenset({1, 6, 7, 15, 22, 30})  # chain drafts forced wrong at these token indices


def truth_row(pos: int, width: int) -> int:
    """Where a branch point's candidates hold the target's token (width: nowhere), varied by position."""
    return (pos * 2654435761 >> 7) % (width + 1)


def forced_candidates(driver, ref: list[int], P: int, width: int, V: int) -> None:
    """Replace each branch point's candidates: distinct wrong tokens, with the target's token at
    truth_row(pos), none when that is W (the branch point is rejected)."""
    original = driver.branches.candidates

    def candidates(req, h_last, plan):
        out = original(req, h_last, plan)
        pos = out[0].pos
        t = ref[pos - P] if pos - P < len(ref) else 0
        tokens = [(t + 1 + r) % V for r in range(width)]
        if truth_row(pos, width) < width:
            tokens[truth_row(pos, width)] = t
        req.drafts.keep_candidates(pos, ["pdm"] * width, None)
        return [Draft(pos, tok) for tok in tokens]

    driver.branches.candidates = candidates


def protocol_ticks(n: int, N: int, P: int, ref: list[int], width: int, when: str, V: int) -> tuple[int, int]:
    """(ticks, branch saves) of the tick protocol with the verdicts the forced run gets."""
    policy = BranchPolicy(width, when)
    state = TickState(n, P, ref[0])

    def right(pos: int, token: int) -> bool:
        return pos - P >= len(ref) or token == ref[pos - P]

    while state.committed < N:
        plan = state.plan()
        pos = plan.draft_pos
        i = pos - P
        chain = ref[i] if i < len(ref) and i not in WRONG else (ref[i] + 1) % V if i < len(ref) else 0
        if plan.branch is None and policy.branches(plan.fill, False):
            t = ref[i] if i < len(ref) else 0
            tokens = [(t + 1 + r) % V for r in range(width)]
            if truth_row(pos, width) < width:
                tokens[truth_row(pos, width)] = t
            drafts = [Draft(pos, tok) for tok in tokens]
        else:
            drafts = [Draft(pos, chain)] * (plan.width if plan.branch is not None else 1)
        verdict = None
        if plan.exit is not None:
            vpos = plan.verify_pos
            prop = plan.proposed
            tokens = [d.token for d in drafts] if prop is None else \
                (list(prop.chains) if prop.pos == plan.branch else [prop.token])
            hit = next((k for k, tok in enumerate(tokens) if right(vpos, tok)), None)
            verdict = Verdict(hit is not None, ref[vpos - P], hit or 0)
        state.advance(drafts, verdict)
    c = state.finish()
    return c.ticks, c.branch_saves


TOPOLOGIES = [(1, False, None), (2, False, None), (3, False, None), (4, True, None), (3, False, (1, 3, 2)),
              (8, False, None)]
IDS = ["n1", "n2", "n3", "n4-colocated", "n3-uneven", "n8"]


def branch_config(n: int, colocate: bool, split, width: int, when: str, **kw):
    """A tiny-llama run with branch width W; n > 6 stages get a model of n layers (one per stage)."""
    if n > 6:
        kw["cfg"] = tiny_cfg("llama", num_layers=n)
    ecfg = tiny_engine_config("llama", n, colocate, branches=width, branch_when=when, **kw)
    if split is not None:
        topo = Topology.build(ecfg.model.cfg.num_layers, stage_layers=split, colocate=colocate)
        ecfg = ecfg.replace(topology=topo)
    return ecfg


@pytest.mark.parametrize("width", [2, 4])
@pytest.mark.parametrize("n,colocate,split", TOPOLOGIES, ids=IDS)
def test_forced_candidates_are_lossless_and_save_ticks(n, colocate, split, width, one_thread):
    when = "refill" if width == 2 else "always"
    ecfg = branch_config(n, colocate, split, width, when)
    V = ecfg.model.cfg.vocab_size
    prompts = random_prompts(ecfg.model.cfg, (5, 23, 8), seed=3)
    points = saves = 0
    with ReferenceExecutor(ecfg) as ex:
        for p in prompts:
            ref = reference(ecfg, p, NEW)
            forced_candidates(ex.driver, ref, len(p), width, V)
            res = ex.generate(p, NEW, (), draft_policy=Policy(ref, len(p), V, wrong=WRONG))
            if agrees(ecfg, p, res.tokens, ref):
                assert (res.ticks, res.branch_saves) == protocol_ticks(n, NEW, len(p), ref, width, when, V)
            points, saves = points + res.branch_points, saves + res.branch_saves
            del ex.driver.branches.candidates
    assert 0 < saves < points  # saved and unsaved branch points both occur


@pytest.mark.parametrize("width,when", [(2, "refill"), (4, "always")])
@pytest.mark.parametrize("n,colocate,split", TOPOLOGIES[1:], ids=IDS[1:])
def test_untrained_pdm_and_suffix_drafts_are_lossless(n, colocate, split, width, when, one_thread):
    ecfg = branch_config(n, colocate, split, width, when, suffix_min_match=1)
    prompts = random_prompts(ecfg.model.cfg, (1, 9, 40), seed=4)
    with ReferenceExecutor(ecfg) as ex:
        for p in prompts:  # one runtime, many requests: each starts after whatever the last left
            res = ex.generate(p, NEW)
            agrees(ecfg, p, res.tokens, reference(ecfg, p, NEW))
            assert res.branch_points > 0


@pytest.mark.parametrize("n", [2, 4])
def test_static_steps_with_branches_are_lossless(n, one_thread):
    """--step-mode static: one-token steps on the static path, chain steps eager."""
    ecfg = branch_config(n, False, None, 2, "always", step_mode="static")
    V = ecfg.model.cfg.vocab_size
    eager = branch_config(n, False, None, 2, "always")
    prompts = random_prompts(ecfg.model.cfg, (7, 19), seed=5)
    with ReferenceExecutor(ecfg) as ex, ReferenceExecutor(eager) as ex_eager:
        for p in prompts:
            ref = reference(ecfg, p, NEW)
            agrees(eager, p, ex_eager.generate(p, NEW).tokens, ref)
            forced_candidates(ex.driver, ref, len(p), 2, V)
            res = ex.generate(p, NEW, (), draft_policy=Policy(ref, len(p), V, wrong=WRONG))
            if agrees(ecfg, p, res.tokens, ref):
                assert res.branch_saves > 0
            del ex.driver.branches.candidates


def test_sampling_with_branches_is_fixed_by_the_seed(one_thread):
    ecfg = branch_config(3, False, None, 2, "always", suffix_min_match=1)
    prompt = random_prompts(ecfg.model.cfg, (11,), seed=6)[0]
    outs = {}
    with ReferenceExecutor(ecfg) as ex:
        for seed in (1, 2, 1):
            res = ex.generate(prompt, NEW, (), sampling=SamplingParams(temperature=1.0, seed=seed))
            assert len(res.tokens) == NEW and res.branch_points > 0
            outs.setdefault(seed, []).append(res.tokens)
    assert outs[1][0] == outs[1][1] and outs[1][0] != outs[2][0]


@pytest.mark.parametrize("n,width", [(2, 2), (3, 4)])
def test_forced_candidates_on_tensor_parallel_stages(n, width, one_thread):
    """--tp 2: the chains' rows go through the sharded layers (one reduction per row-parallel
    layer, all rows at once) and the survivor's entries move in every shard's cache."""
    from tp_cases import serial_tp, tp_engine_config

    from spd_engine.engine.model.greedy import greedy_generate

    ecfg = tp_engine_config("spd", n, 2).replace(branches=width, branch_when="always")
    V = ecfg.model.cfg.vocab_size
    oracle = serial_tp(ecfg)
    saves = 0
    with ReferenceExecutor(ecfg) as ex:
        for p in random_prompts(ecfg.model.cfg, (5, 19), seed=8):
            ref = greedy_generate(oracle, p, NEW, chunk=ecfg.runtime.prefill_chunk)
            forced_candidates(ex.driver, ref, len(p), width, V)
            res = ex.generate(p, NEW, (), draft_policy=Policy(ref, len(p), V, wrong=WRONG))
            k = assert_greedy_agrees(res.tokens, ref, teacher_forced(full_model(ecfg), p, ref), 1e-4, "TP W")
            if k is None:  # the TP oracle's tokens (its sums are the shards'): the tick protocol's counts
                assert (res.ticks, res.branch_saves) == protocol_ticks(n, NEW, len(p), ref, width, "always", V)
            saves += res.branch_saves
            del ex.driver.branches.candidates
    assert saves > 0


def test_branch_width_needs_spd():
    with pytest.raises(ValueError, match="--branches must be >= 1"):
        tiny_engine_config("llama", 2, branches=0)
    with pytest.raises(ValueError, match="needs --mode spd"):
        tiny_engine_config("llama", 2, mode="pp", branches=2)
    with pytest.raises(ValueError, match="branch policy"):
        tiny_engine_config("llama", 2, branches=2, branch_when="sometimes")


def test_one_pdm_pass_over_the_chains_equals_one_pass_per_chain(one_thread):
    """The driver drafts every chain from one PDM pass with a tree mask; each chain's last hidden
    state is what a pass over that chain's own rows alone gives (up to float rounding)."""
    import torch

    ecfg = branch_config(3, False, None, 2, "always", suffix_min_match=1)
    prompt = random_prompts(ecfg.model.cfg, (13,), seed=7)[0]
    checked = []
    with ReferenceExecutor(ecfg) as ex:
        d = ex.driver
        batched = d.branches.chain_pass

        def compare(plan):
            types = d.buf.types_of(plan)
            want = []
            for c in range(plan.width):
                flat = [d.buf.slot(r.pos) + (c * d.buf.num_slots if r.pos >= plan.branch else 0) for r in plan.rows]
                rows = d.pdm.rows_from_ring(d.buf.rings.view(-1, *d.buf.rings.shape[2:]), torch.tensor(flat), types)
                want.append(d.pdm.forward_rows(rows[None], d.pdm_cache, plan.pdm_pos)[0, -1])
            got = batched(plan)
            torch.testing.assert_close(got, torch.stack(want), atol=1e-5, rtol=1e-4)
            checked.append(len(plan.rows))
            return got

        d.branches.chain_pass = compare
        res = ex.generate(prompt, NEW)
    agrees(ecfg, prompt, res.tokens, reference(ecfg, prompt, NEW))
    assert len(checked) > 5 and len(set(checked)) > 1  # several passes, several staircase lengths
